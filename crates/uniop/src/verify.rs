//! Checking ops against their f64 references — shared by `uniop run` and the test suites so both
//! judge an op by the same rule.

use crate::dtype::DType;
use crate::error::Result;
use crate::executor::Executor;
use crate::layout::TensorMeta;
use crate::op::{Example, RefTensor};
use crate::registry::OpEntry;
use crate::runtime::{Allocator, MemPolicy, Stream};
use crate::schema::AttrValue;
use crate::tensor::{Tensor, TensorMut, TensorRef};
use std::time::{Duration, Instant};

/// Elementwise tolerance `|got - want| ≤ atol + rtol·|want|`, by output dtype. Half types get
/// about one unit in the last place of slack for rounding the f32 result.
pub fn tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-10, 1e-10),
        DType::F32 => (1e-5, 1e-4),
        DType::F16 => (1e-3, 2e-3),
        DType::BF16 => (1e-2, 1.6e-2),
        _ => (0.0, 0.0),
    }
}

#[derive(Clone, Debug)]
pub struct OutputCheck {
    pub name: String,
    pub dtype: DType,
    pub max_abs: f64,
    pub max_rel: f64,
    /// Linear index of the worst element (relative to its tolerance).
    pub worst: Option<usize>,
    /// A storage element outside the tensor's view (a padded row's tail, a skipped element) that
    /// the run changed: the kernel wrote memory that is not its output. Checked by
    /// [`OpHarness::check`]; fails the check.
    pub wrote_outside: Option<usize>,
    pub pass: bool,
}

#[derive(Clone, Debug)]
pub struct CheckReport {
    pub op: String,
    pub outputs: Vec<OutputCheck>,
}

impl CheckReport {
    pub fn pass(&self) -> bool {
        self.outputs.iter().all(|o| o.pass)
    }
}

impl std::fmt::Display for CheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for o in &self.outputs {
            writeln!(
                f,
                "  {:<10} {:<9} max abs err {:.3e}  max rel err {:.3e}  {}",
                o.name,
                o.dtype.name(),
                o.max_abs,
                o.max_rel,
                if o.pass { "PASS" } else { "FAIL" }
            )?;
            if let Some(at) = o.wrote_outside {
                writeln!(f, "  {:<10} wrote storage element {at}, outside its view", o.name)?;
            }
        }
        Ok(())
    }
}

/// Compares `outputs` with the op's f64 reference computed from the same (already rounded)
/// inputs, so only the kernel's own error is measured.
pub fn check_outputs(
    entry: &OpEntry,
    inputs: &[Option<TensorRef<'_>>],
    attrs: &[(&str, AttrValue)],
    outputs: &[TensorRef<'_>],
) -> Result<CheckReport> {
    let metas = inputs.iter().map(|t| t.as_ref().map(|t| t.meta().clone())).collect();
    let cx = entry.bind_flat(metas, attrs)?;
    let mut refs: Vec<Option<RefTensor>> = inputs.iter().map(|t| t.as_ref().map(RefTensor::from_view)).collect();
    // Trailing optional tensors left out are absent (one slot per tensor argument, as kernels see).
    refs.resize_with(cx.inputs.len(), || None);
    let want = entry.op.reference(&cx, &refs)?;
    let scale = entry.op.error_scale(&cx);
    let mut checks = Vec::new();
    for (i, (got, want)) in outputs.iter().zip(&want).enumerate() {
        let (atol, rtol) = tolerance(got.dtype());
        let atol = atol * scale;
        let got_values = got.to_f64_vec();
        let mut check = OutputCheck {
            name: entry.schema.output_name(i),
            dtype: got.dtype(),
            max_abs: 0.0,
            max_rel: 0.0,
            worst: None,
            wrote_outside: None,
            pass: true,
        };
        let mut worst_ratio = 0.0f64;
        assert_eq!(got_values.len(), want.data.len(), "reference and output sizes differ");
        for (j, (&g, &w)) in got_values.iter().zip(&want.data).enumerate() {
            let w = overflowed_in(got.dtype(), w).unwrap_or(w);
            let abs = (g - w).abs();
            let same_nonfinite = !w.is_finite() && g.to_bits() == w.to_bits() || (w.is_nan() && g.is_nan());
            let abs = if same_nonfinite {
                0.0
            } else if abs.is_nan() {
                f64::INFINITY
            } else {
                abs
            };
            check.max_abs = check.max_abs.max(abs);
            check.max_rel = check.max_rel.max(abs / w.abs().max(f64::MIN_POSITIVE));
            let ratio = if abs == 0.0 { 0.0 } else { abs / (atol + rtol * w.abs()) };
            if ratio > worst_ratio || (ratio.is_nan() && check.worst.is_none()) {
                worst_ratio = ratio;
                check.worst = Some(j);
            }
        }
        check.pass = worst_ratio <= 1.0;
        checks.push(check);
    }
    Ok(CheckReport { op: entry.name().to_string(), outputs: checks })
}

/// The infinity `dtype` stores for a finite `value` past its range, if it overflows. A kernel
/// that rounds a true result of 1e5 to f16 must write inf (IEEE round-to-nearest), so the check
/// holds it to the reference as the output can hold it; values in range keep their exact
/// reference, so the tolerances still measure the kernel's own error.
fn overflowed_in(dtype: DType, value: f64) -> Option<f64> {
    let held = match dtype {
        DType::F32 => value as f32 as f64,
        DType::F16 => half::f16::from_f64(value).to_f64(),
        DType::BF16 => half::bf16::from_f64(value).to_f64(),
        _ => value,
    };
    (value.is_finite() && held.is_infinite()).then_some(held)
}

/// The byte an [`OpHarness`]'s returns start filled with: a NaN in every float dtype (-1 in the
/// integer ones), so an element a kernel leaves unwritten fails the check rather than passing on
/// whatever the allocator's block held (often the zero a reference expects). Bool returns are
/// left alone (0xFF is no bool).
const POISON: u8 = 0xFF;

/// SplitMix64: tiny, seedable, good enough for test data (not for sampling).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// Fills every addressable element of `t` with uniform values in [-1, 1) (small integers for
/// integer dtypes, alternating for bool).
pub fn fill_random(t: &mut TensorMut<'_>, rng: &mut Rng) {
    fill_random_in(t, rng, None)
}

/// Like [`fill_random`], drawing from `[lo, hi)` when a range is given (integers: `floor`).
pub fn fill_random_in(t: &mut TensorMut<'_>, rng: &mut Rng, range: Option<(f64, f64)>) {
    let dtype = t.dtype();
    crate::dispatch_element!(dtype, |T| {
        let data = t.storage_mut::<T>().expect("dtype matches");
        for x in data.iter_mut() {
            let u = rng.uniform();
            let v = match range {
                Some((lo, hi)) => {
                    let v = lo + (u + 1.0) / 2.0 * (hi - lo);
                    if dtype.is_float() {
                        v
                    } else {
                        v.floor()
                    }
                }
                None if dtype.is_float() => u,
                None => (u * 8.0).round(),
            };
            *x = <T as crate::Element>::from_f64(v);
        }
    })
}

/// How long [`OpHarness::bench`] runs an op before timing it. On the 2-vCPU cloud machines the
/// pool's second thread came back from idle slow: a bf16 `permute` of 16 MiB took 3.6 ms on
/// the first launches after the probes and 1.25 ms from the eighth on (about 25 ms later), and
/// best-of-3 figures carried that ramp into the torch comparison. One thread alone showed none.
const BENCH_WARM_UP: Duration = Duration::from_millis(200);

/// Allocated inputs and outputs for one example of an op, ready to run, check and time.
///
/// `inputs` holds every tensor argument in schema order with the values the op starts from —
/// for in-place arguments too, which is what the reference needs. `outputs` holds what the op
/// writes: copies of the in-place arguments, then the returns.
pub struct OpHarness {
    pub entry: std::sync::Arc<OpEntry>,
    pub inputs: Vec<Option<Tensor>>,
    pub outputs: Vec<Tensor>,
    pub attrs: Vec<(String, AttrValue)>,
}

impl OpHarness {
    /// The op's example with random inputs (drawn from the example's ranges) and contiguous outputs.
    pub fn new(entry: std::sync::Arc<OpEntry>, example: Example, seed: u64) -> Result<OpHarness> {
        let inputs = random_inputs(&example, seed, |m| m.clone())?;
        Self::with_inputs(entry, inputs, example.attrs, |m| m.clone())
    }

    /// A harness over given inputs; `out_layout` picks each written tensor's layout from its
    /// contiguous meta (in-place arguments keep their input's layout).
    pub fn with_inputs(
        entry: std::sync::Arc<OpEntry>,
        inputs: Vec<Option<Tensor>>,
        attrs: Vec<(String, AttrValue)>,
        out_layout: impl Fn(&TensorMeta) -> TensorMeta,
    ) -> Result<OpHarness> {
        let out_metas = {
            let views: Vec<Option<TensorRef<'_>>> = inputs.iter().map(|t| t.as_ref().map(Tensor::view)).collect();
            infer(&entry, &views, &attr_refs(&attrs))?
        };
        let mut outputs = Vec::new();
        for i in in_place_positions(&entry, inputs.len()) {
            let source = inputs[i].as_ref().expect("in-place arguments are required tensors");
            outputs.push(Tensor::copy_of(&source.view())?);
        }
        for m in out_metas {
            let t = Tensor::with_meta(out_layout(&m))?;
            if t.dtype() != DType::Bool {
                // SAFETY: a fresh tensor no kernel has seen.
                unsafe { t.buffer().as_mut_slice() }.fill(POISON);
            }
            outputs.push(t);
        }
        Ok(OpHarness { entry, inputs, outputs, attrs })
    }

    /// The first storage element outside written tensor `o`'s view that no longer holds what it
    /// started with (see [`OutputCheck::wrote_outside`]): an in-place argument's copy of its input
    /// (gaps and all), a return's [`POISON`].
    fn written_outside(&self, o: usize) -> Option<usize> {
        let t = &self.outputs[o];
        let layout = &t.meta().layout;
        if layout.dense_range().is_some_and(|r| r.start == 0) {
            return None; // the view is all of its storage
        }
        // SAFETY: runs are synchronous and no kernel writes the inputs; nothing writes these
        // buffers while they are read.
        let source = in_place_positions(&self.entry, self.inputs.len())
            .get(o)
            .map(|&i| unsafe { self.inputs[i].as_ref().expect("in-place arguments are given").buffer().as_slice() });
        if source.is_none() && t.dtype() == DType::Bool {
            return None; // not poisoned
        }
        let (size, extent) = (t.dtype().size(), layout.storage_extent().ok()?);
        let mut in_view = vec![false; extent];
        for i in 0..layout.numel() {
            in_view[layout.offset_of_linear(i)] = true;
        }
        let bytes = unsafe { t.buffer().as_slice() };
        let first = |b: usize| source.map_or(POISON, |s| s[b]);
        (0..extent).find(|&e| !in_view[e] && (e * size..(e + 1) * size).any(|b| bytes[b] != first(b)))
    }

    fn executor(&mut self) -> Result<Executor<'_>> {
        let in_place = in_place_positions(&self.entry, self.inputs.len());
        let views: Vec<Option<TensorRef<'_>>> = self
            .inputs
            .iter()
            .enumerate()
            .filter(|(i, _)| !in_place.contains(i))
            .map(|(_, t)| t.as_ref().map(Tensor::view))
            .collect();
        let outs: Vec<TensorMut<'_>> = self.outputs.iter_mut().map(Tensor::view_mut).collect();
        Executor::new(self.entry.clone(), &views, &attr_refs(&self.attrs), outs)
    }

    /// Resets the in-place outputs to the inputs' starting values, so a check after a run
    /// compares one application of the op.
    fn reset_in_place(&mut self) -> Result<()> {
        for (o, i) in in_place_positions(&self.entry, self.inputs.len()).into_iter().enumerate() {
            let source = self.inputs[i].as_ref().expect("in-place arguments are required tensors");
            self.outputs[o].copy_from(&source.view())?;
        }
        Ok(())
    }

    /// Plans and runs once on `stream` (both phases) from the starting values, returning the wall
    /// time of the pair.
    pub fn run(&mut self, stream: &Stream) -> Result<Duration> {
        self.reset_in_place()?;
        let t0 = Instant::now();
        let mut exec = self.executor()?;
        let ws = Allocator::global().allocate(exec.workspace_size(), MemPolicy::HugeFirst)?;
        // SAFETY: the workspace buffer is exclusively ours until `run` returns.
        exec.run(unsafe { ws.as_mut_slice() }, stream)?;
        Ok(t0.elapsed())
    }

    /// Best-of-`iters` time of phase 2 with a repeatable executor, after warm-up launches that
    /// run for at least [`BENCH_WARM_UP`].
    pub fn bench(&mut self, stream: &Stream, iters: usize) -> Result<Duration> {
        let mut exec = self.executor()?;
        exec.set_repeatable();
        let ws = Allocator::global().allocate(exec.workspace_size(), MemPolicy::HugeFirst)?;
        // SAFETY: as in `run`.
        let ws = unsafe { ws.as_mut_slice() };
        let warming = Instant::now();
        loop {
            exec.run(ws, stream)?;
            if warming.elapsed() >= BENCH_WARM_UP {
                break;
            }
        }
        let mut best = Duration::MAX;
        for _ in 0..iters {
            let t0 = Instant::now();
            exec.run(ws, stream)?;
            best = best.min(t0.elapsed());
        }
        Ok(best)
    }

    /// Compares the outputs of the latest [`OpHarness::run`] with the reference, and checks that
    /// the storage around each written view is as it was.
    pub fn check(&self) -> Result<CheckReport> {
        let views: Vec<Option<TensorRef<'_>>> = self.inputs.iter().map(|t| t.as_ref().map(Tensor::view)).collect();
        let outs: Vec<TensorRef<'_>> = self.outputs.iter().map(Tensor::view).collect();
        let mut report = check_outputs(&self.entry, &views, &attr_refs(&self.attrs), &outs)?;
        for (o, check) in report.outputs.iter_mut().enumerate() {
            check.wrote_outside = self.written_outside(o);
            check.pass &= check.wrote_outside.is_none();
        }
        Ok(report)
    }

    /// Bytes read and written by one launch: the op's own count when it has one (ops that touch
    /// part of a tensor), else each tensor element once.
    pub fn bytes_moved(&self) -> Result<usize> {
        let metas = self.inputs.iter().map(|t| t.as_ref().map(|t| t.meta().clone())).collect();
        let cx = self.entry.bind_flat(metas, &attr_refs(&self.attrs))?;
        if let Some(bytes) = self.entry.op.bytes_moved(&cx) {
            return Ok(bytes);
        }
        let size = |m: &TensorMeta| m.numel() * m.dtype.size();
        let in_place = in_place_positions(&self.entry, self.inputs.len());
        Ok(self
            .inputs
            .iter()
            .enumerate()
            .filter(|(i, _)| !in_place.contains(i))
            .flat_map(|(_, t)| t.as_ref())
            .map(|t| size(t.meta()))
            .sum::<usize>()
            + self.outputs.iter().map(|t| size(t.meta())).sum::<usize>())
    }
}

/// Random tensors for an example's inputs, each laid out by `layout` from its example meta.
pub fn random_inputs(
    example: &Example,
    seed: u64,
    layout: impl Fn(&TensorMeta) -> TensorMeta,
) -> Result<Vec<Option<Tensor>>> {
    let mut rng = Rng::new(seed);
    let mut inputs = Vec::new();
    for (i, meta) in example.inputs.iter().enumerate() {
        inputs.push(match meta {
            Some(m) => {
                let mut t = Tensor::with_meta(layout(m))?;
                fill_random_in(&mut t.view_mut(), &mut rng, example.ranges.get(i).copied().flatten());
                Some(t)
            }
            None => None,
        });
    }
    Ok(inputs)
}

/// Positions of in-place (`Tensor(a!)`) arguments among `n` flattened tensor arguments.
pub fn in_place_positions(entry: &OpEntry, n: usize) -> Vec<usize> {
    let mut at = 0;
    let mut positions = Vec::new();
    for (arg, take) in entry.schema.tensor_args(n, true) {
        if arg.ty.mutated.is_some() {
            positions.push(at);
        }
        at += take;
    }
    positions
}

/// Borrowed `(name, value)` pairs from owned ones.
pub fn attr_refs(attrs: &[(String, AttrValue)]) -> Vec<(&str, AttrValue)> {
    attrs.iter().map(|(k, v)| (k.as_str(), v.clone())).collect()
}

/// Output metas for these inputs and attributes (what a framework's fake/meta kernel needs).
pub fn infer(
    entry: &OpEntry,
    inputs: &[Option<TensorRef<'_>>],
    attrs: &[(&str, AttrValue)],
) -> Result<Vec<TensorMeta>> {
    let metas = inputs.iter().map(|t| t.as_ref().map(|t| t.meta().clone())).collect();
    let cx = entry.bind_flat(metas, attrs)?;
    entry.infer(&cx)
}
