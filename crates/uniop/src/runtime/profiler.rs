//! The profiler: one event per launch (op, kernel step, input/output dtypes and shapes, backend,
//! block_dim, stream, start/end, bytes), summarised as an op table (like msprof's op summary) or
//! written as a Chrome/Perfetto trace.
//!
//! Why here, under the launch engine, and not in each frontend: every way of calling an op — the
//! C two-phase pair, Python, torch, ONNX Runtime, a raw kernel launch — ends in a stream task run
//! by the compute pool, so timing that one place profiles them all alike and with the same clock.
//!
//! Recording is process-wide ([`start`] … [`stop`]). While it is off a launch pays one relaxed
//! atomic load; while it is on, each launch carries a [`Label`] built at enqueue time and its
//! task is timed around the whole SPMD launch (every block, on whichever threads ran them).
//! Launches still queued when the profiler stops are not recorded: synchronize first.

use crate::error::{Error, ErrorCode, Result};
use crate::layout::ShapeDisplay;
use crate::layout::TensorMeta;
use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What a launch was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LaunchKind {
    /// A step of an op's plan.
    Op,
    /// A staging copy of an op's tensor into (or out of) workspace, for a layout the kernel lacks.
    Staging,
    /// A kernel direct call (`Stream::launch`, `uniopLaunchKernel`).
    Kernel,
}

impl LaunchKind {
    pub fn name(self) -> &'static str {
        match self {
            LaunchKind::Op => "op",
            LaunchKind::Staging => "staging",
            LaunchKind::Kernel => "kernel",
        }
    }
}

/// Everything known about a launch when it is enqueued; shared by the launch and its event.
#[derive(Debug)]
pub struct Label {
    session: u64,
    /// The op's name (`"kernel"` for a direct call).
    pub op: Arc<str>,
    /// The plan step's name, `"copy_in"`/`"copy_out"` for staging, `"kernel"` for a direct call.
    pub step: &'static str,
    pub kind: LaunchKind,
    /// Inputs and outputs, e.g. `f32[4, 4096], f32[4096] -> f32[4, 4096], f32[4, 1]`.
    pub signature: Arc<str>,
    /// Bytes the launch reads and writes at least once (its tensors' sizes).
    pub bytes: u64,
    pub block_dim: u32,
}

/// One recorded launch.
#[derive(Clone, Debug)]
pub struct LaunchEvent {
    pub label: Arc<Label>,
    pub stream: u64,
    /// Nanoseconds since the profiler started.
    pub start_ns: u64,
    pub end_ns: u64,
}

impl LaunchEvent {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns - self.start_ns
    }
}

struct Session {
    id: u64,
    origin: Instant,
    events: Vec<LaunchEvent>,
}

static RECORDING: AtomicBool = AtomicBool::new(false);
static SESSION: Mutex<Option<Session>> = Mutex::new(None);
static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// The profiler's lock, held by [`fork`](super::fork)'s handler while the process forks: a stream
/// worker takes it after each launch while the profiler records.
pub(crate) fn hold_for_fork() -> Box<dyn std::any::Any> {
    Box::new(SESSION.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Whether launches are being recorded (the one check a launch pays while the profiler is off).
#[inline]
pub fn is_recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

/// Starts recording every launch in the process. Fails if a profiler is already recording
/// (there is one timeline; nested profilers would each see only part of it).
pub fn start() -> Result<()> {
    let mut session = SESSION.lock().unwrap_or_else(|e| e.into_inner());
    if session.is_some() {
        return Err(Error::new(
            ErrorCode::ParamInvalid,
            "profiler: start: a profiler is already recording (stop it first; there is one per process)",
        ));
    }
    *session =
        Some(Session { id: NEXT_SESSION.fetch_add(1, Ordering::Relaxed), origin: Instant::now(), events: Vec::new() });
    RECORDING.store(true, Ordering::Relaxed);
    Ok(())
}

/// Stops recording and returns what was recorded. Fails if no profiler is recording.
pub fn stop() -> Result<Profile> {
    let mut session = SESSION.lock().unwrap_or_else(|e| e.into_inner());
    let Some(s) = session.take() else {
        return Err(Error::new(ErrorCode::ParamInvalid, "profiler: stop: no profiler is recording (call start first)"));
    };
    RECORDING.store(false, Ordering::Relaxed);
    let wall_ns = s.origin.elapsed().as_nanos() as u64;
    let mut events = s.events;
    events.sort_by_key(|e| e.start_ns);
    Ok(Profile { events, wall_ns })
}

/// A label for a launch being enqueued now, or `None` while the profiler is off.
pub(crate) fn label(
    op: impl FnOnce() -> Arc<str>,
    step: &'static str,
    kind: LaunchKind,
    signature: impl FnOnce() -> (Arc<str>, u64),
    block_dim: u32,
) -> Option<Arc<Label>> {
    if !is_recording() {
        return None;
    }
    let session = SESSION.lock().unwrap_or_else(|e| e.into_inner()).as_ref()?.id;
    let (signature, bytes) = signature();
    Some(Arc::new(Label { session, op: op(), step, kind, signature, bytes, block_dim }))
}

/// Records a launch that ran from `start` to `end` on stream `stream` — if the session that
/// labelled it is still recording.
pub(crate) fn record(label: &Arc<Label>, stream: u64, start: Instant, end: Instant) {
    let mut session = SESSION.lock().unwrap_or_else(|e| e.into_inner());
    let Some(s) = session.as_mut().filter(|s| s.id == label.session) else { return };
    let since = |t: Instant| t.saturating_duration_since(s.origin).as_nanos() as u64;
    let event = LaunchEvent { label: label.clone(), stream, start_ns: since(start), end_ns: since(end) };
    s.events.push(event);
}

/// `f32[4, 4096], f32[4096] -> f32[4, 4096]` and the bytes of all those tensors.
pub fn describe_tensors<'m>(
    inputs: impl Iterator<Item = &'m TensorMeta>,
    outputs: impl Iterator<Item = &'m TensorMeta>,
) -> (Arc<str>, u64) {
    fn list<'m>(metas: impl Iterator<Item = &'m TensorMeta>, text: &mut String, bytes: &mut u64) {
        for (i, m) in metas.enumerate() {
            if i > 0 {
                text.push_str(", ");
            }
            let _ = write!(text, "{}{}", m.dtype.short_name(), ShapeDisplay(m.shape()));
            *bytes += (m.numel() * m.dtype.size()) as u64;
        }
    }
    let (mut text, mut bytes) = (String::new(), 0u64);
    list(inputs, &mut text, &mut bytes);
    text.push_str(" -> ");
    list(outputs, &mut text, &mut bytes);
    (text.into(), bytes)
}

/// The launches of one profiling session, in start order.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    events: Vec<LaunchEvent>,
    wall_ns: u64,
}

/// One row of [`Profile::summary_rows`]: the launches of one op step with one signature.
#[derive(Clone, Debug)]
pub struct SummaryRow {
    pub op: Arc<str>,
    pub step: &'static str,
    pub kind: LaunchKind,
    pub signature: Arc<str>,
    pub calls: u64,
    pub total_ns: u64,
    pub min_ns: u64,
    pub max_ns: u64,
    pub bytes: u64,
}

impl SummaryRow {
    /// Bytes moved per second of launch time, in GB/s (10⁹ bytes).
    pub fn gb_per_s(&self) -> f64 {
        if self.total_ns == 0 {
            return 0.0;
        }
        self.bytes as f64 / self.total_ns as f64
    }
}

impl Profile {
    pub fn events(&self) -> &[LaunchEvent] {
        &self.events
    }

    /// Nanoseconds from start to stop.
    pub fn wall_ns(&self) -> u64 {
        self.wall_ns
    }

    /// Launch time summed per (op, step, kind, signature), longest total first.
    pub fn summary_rows(&self) -> Vec<SummaryRow> {
        let mut rows: HashMap<(&str, &str, LaunchKind, &str), SummaryRow> = HashMap::new();
        for e in &self.events {
            let l = &e.label;
            let d = e.duration_ns();
            let row = rows.entry((&l.op, l.step, l.kind, &l.signature)).or_insert_with(|| SummaryRow {
                op: l.op.clone(),
                step: l.step,
                kind: l.kind,
                signature: l.signature.clone(),
                calls: 0,
                total_ns: 0,
                min_ns: u64::MAX,
                max_ns: 0,
                bytes: 0,
            });
            row.calls += 1;
            row.total_ns += d;
            row.min_ns = row.min_ns.min(d);
            row.max_ns = row.max_ns.max(d);
            row.bytes += l.bytes;
        }
        let mut rows: Vec<SummaryRow> = rows.into_values().collect();
        rows.sort_by(|a, b| b.total_ns.cmp(&a.total_ns).then_with(|| a.op.cmp(&b.op)));
        rows
    }

    /// The op summary table: the `top` rows of [`Profile::summary_rows`] (all when `top` is 0),
    /// with each row's share of the total launch time.
    pub fn summary(&self, top: usize) -> String {
        let rows = self.summary_rows();
        let busy: u64 = rows.iter().map(|r| r.total_ns).sum();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "uniop profile: {} launches, {:.3} ms in launches over {:.3} ms wall",
            self.events.len(),
            busy as f64 / 1e6,
            self.wall_ns as f64 / 1e6
        );
        let _ = writeln!(
            out,
            "{:<20} {:<24} {:<7} {:>7} {:>10} {:>9} {:>9} {:>9} {:>6} {:>7}  tensors",
            "op", "step", "kind", "calls", "total ms", "avg us", "min us", "max us", "%", "GB/s"
        );
        let shown = if top == 0 { rows.len() } else { top.min(rows.len()) };
        for r in &rows[..shown] {
            let _ = writeln!(
                out,
                "{:<20} {:<24} {:<7} {:>7} {:>10.3} {:>9.2} {:>9.2} {:>9.2} {:>6.1} {:>7.1}  {}",
                r.op,
                r.step,
                r.kind.name(),
                r.calls,
                r.total_ns as f64 / 1e6,
                r.total_ns as f64 / r.calls as f64 / 1e3,
                r.min_ns as f64 / 1e3,
                r.max_ns as f64 / 1e3,
                if busy == 0 { 0.0 } else { 100.0 * r.total_ns as f64 / busy as f64 },
                r.gb_per_s(),
                r.signature
            );
        }
        if shown < rows.len() {
            let _ = writeln!(out, "({} more rows)", rows.len() - shown);
        }
        out
    }

    /// The events as Chrome trace JSON (`chrome://tracing`, ui.perfetto.dev): one complete
    /// event per launch, one track per stream.
    pub fn chrome_trace(&self) -> String {
        let events: Vec<serde_json::Value> = self
            .events
            .iter()
            .map(|e| {
                let l = &e.label;
                serde_json::json!({
                    "name": l.op.as_ref(),
                    "cat": l.kind.name(),
                    "ph": "X",
                    "ts": e.start_ns as f64 / 1e3,
                    "dur": e.duration_ns() as f64 / 1e3,
                    "pid": std::process::id(),
                    "tid": e.stream,
                    "args": {
                        "step": l.step,
                        "tensors": l.signature.as_ref(),
                        "bytes": l.bytes,
                        "block_dim": l.block_dim,
                        "backend": "cpu",
                    },
                })
            })
            .collect();
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::Stream;

    /// The profiler is process-wide: tests that start it take turns.
    pub(crate) static EXCLUSIVE: Mutex<()> = Mutex::new(());

    #[test]
    fn direct_launches_are_recorded_with_their_stream_and_time() {
        let _turn = EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner());
        let stream = Stream::new();
        start().unwrap();
        assert!(start().is_err(), "a second profiler must be refused");
        stream.launch(3, |_| std::thread::sleep(std::time::Duration::from_millis(2)));
        stream.synchronize().unwrap();
        let profile = stop().unwrap();
        assert!(stop().is_err(), "stopping twice must fail");
        let mine: Vec<_> = profile.events().iter().filter(|e| e.stream == stream.id()).collect();
        assert_eq!(mine.len(), 1);
        let e = mine[0];
        assert_eq!((e.label.kind, e.label.block_dim, e.label.op.as_ref()), (LaunchKind::Kernel, 3, "kernel"));
        // Three 2 ms blocks on at most a pool's worth of threads: at least 2 ms, and within the wall time.
        assert!(e.duration_ns() >= 2_000_000, "{e:?}");
        assert!(e.end_ns <= profile.wall_ns());
        assert!(profile.summary(0).contains("kernel"));
        let trace: serde_json::Value = serde_json::from_str(&profile.chrome_trace()).unwrap();
        let ours = trace["traceEvents"].as_array().unwrap().iter().find(|t| t["tid"] == stream.id()).unwrap();
        assert_eq!(ours["ph"], "X");
        assert_eq!(ours["args"]["block_dim"], 3);
    }

    #[test]
    fn nothing_is_recorded_while_stopped() {
        let _turn = EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner());
        let stream = Stream::new();
        stream.launch(1, |_| {});
        stream.synchronize().unwrap();
        start().unwrap();
        let profile = stop().unwrap();
        assert!(profile.events().iter().all(|e| e.stream != stream.id()));
    }
}
