//! `uniop`: the command-line face of the registry and the runtime.
//!
//! Like every frontend it never names an op: `list`, `describe`, `run`, `profile` and `bench` work from the
//! registry's schemas and each op's `example` and `reference`.

mod bench;
mod demo;

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use uniop::verify::OpHarness;
use uniop::{AttrValue, DType, Error, Registry, Result, Stream};

#[derive(Parser)]
#[command(
    name = "uniop",
    version,
    about = "Write an operator once, call it from everywhere — CPU runtime and op library"
)]
struct Cli {
    /// Load an op library (a Rust crate built with `uniop::export_ops!`) before running; repeatable.
    #[arg(long = "plugin", value_name = "PATH", global = true)]
    plugins: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List registered ops with their dtypes and schemas.
    List,
    /// Show an op's schema, arguments, dtypes, backward and documentation.
    Describe { op: String },
    /// Run ops on random inputs, check them against their f64 reference and time them.
    Run(RunArgs),
    /// `run` under the profiler: the op summary table of every launch, optionally a Chrome trace.
    Profile(ProfileArgs),
    /// Benchmark ops against a STREAM bandwidth probe, plus SPMD launch overhead.
    Bench(bench::BenchArgs),
    /// Show a raw SPMD kernel launch on two streams with an event dependency and event timing.
    Demo,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Op name, or `all` for every registered op.
    op: String,
    /// Main input shape, e.g. 4x4096 (default: the op's representative shape).
    #[arg(long)]
    shape: Option<String>,
    /// Element type: f32, f16, bf16, ... (default: every dtype the op supports when `all`, else f32).
    #[arg(long)]
    dtype: Option<String>,
    /// Attribute override, e.g. --attr eps=1e-5 (repeatable).
    #[arg(long = "attr", value_name = "NAME=VALUE")]
    attrs: Vec<String>,
    /// Timed repetitions (best-of) after one warm-up.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Seed for the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(clap::Args)]
struct ProfileArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Rows of the summary table (0: all).
    #[arg(long, default_value_t = 20)]
    top: usize,
    /// Also write the launches as Chrome trace JSON (chrome://tracing, ui.perfetto.dev).
    #[arg(long, value_name = "PATH")]
    trace: Option<std::path::PathBuf>,
}

/// Runs `args.run` with the profiler recording, then prints the summary (and writes the trace).
fn profile(args: &ProfileArgs) -> Result<bool> {
    uniop::runtime::profiler::start()?;
    let ran = run(&args.run);
    let profile = uniop::runtime::profiler::stop()?;
    let passed = ran?;
    println!("\n{}", profile.summary(args.top));
    if let Some(path) = &args.trace {
        std::fs::write(path, profile.chrome_trace())
            .map_err(|e| Error::invalid(format!("--trace: cannot write {}: {e}", path.display())))?;
        println!("trace written to {}", path.display());
    }
    Ok(passed)
}

pub(crate) fn parse_shape(s: &str) -> Result<Vec<usize>> {
    if s.is_empty() || s == "scalar" {
        return Ok(vec![]);
    }
    s.split(['x', 'X', ','])
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .map_err(|_| Error::invalid(format!("bad --shape '{s}': expected dims like 4x4096")))
        })
        .collect()
}

fn parse_attr(s: &str) -> Result<(String, AttrValue)> {
    let (k, v) = s.split_once('=').ok_or_else(|| Error::invalid(format!("bad --attr '{s}': expected NAME=VALUE")))?;
    Ok((k.to_string(), AttrValue::parse_literal(v)))
}

fn list() {
    println!("{:<20} {:<28} {:<20} schema", "op", "dtypes", "backward");
    for entry in Registry::global().list() {
        let dtypes: Vec<_> = entry.op.dtypes().iter().map(|d| d.short_name()).collect();
        println!(
            "{:<20} {:<28} {:<20} {}",
            entry.name(),
            dtypes.join(","),
            entry.op.backward().unwrap_or("-"),
            entry.schema
        );
    }
}

fn describe(op: &str) -> Result<()> {
    let entry = Registry::global().get(op)?;
    let s = &entry.schema;
    println!("{}\n", s);
    println!("inputs:");
    for a in s.inputs() {
        println!("  {:<12} {}", a.name, a.ty);
    }
    if s.attrs().next().is_some() {
        println!("attributes:");
        for a in s.attrs() {
            let default = a.default.as_ref().map(|d| format!(" = {d}")).unwrap_or_default();
            println!("  {:<12} {}{}{}", a.name, a.ty, default, if a.kwarg_only { "  (keyword-only)" } else { "" });
        }
    }
    println!("outputs:");
    for i in 0..s.returns.len() {
        println!("  {:<12} {}", s.return_name(i), s.returns[i].ty);
    }
    let dtypes: Vec<_> = entry.op.dtypes().iter().map(|d| d.name()).collect();
    println!("dtypes:   {}", dtypes.join(", "));
    println!("backward: {}", entry.op.backward().unwrap_or("none"));
    let (rows, cores) = (entry.op.leading_batch_args(), entry.op.core_dims());
    let batching = match (entry.op.elementwise(), rows.is_empty()) {
        (true, _) => "elementwise: one call over operands given a leading batch dim".to_string(),
        (false, true) if !cores.is_empty() => {
            let cores: Vec<_> = cores.iter().map(|(name, rank)| format!("{name} (core rank {rank})")).collect();
            format!("blocks over broadcast batch dims of {}: one call over a leading batch dim", cores.join(", "))
        }
        (false, false) => {
            // The op's doc says what its batch_dims keeps apart (sums per sample, dims in place).
            let raised = if s.args.iter().any(|a| a.name == "batch_dims") { ", batch_dims raised by one" } else { "" };
            format!(
                "row by row along the leading dims of {}: one call over a leading batch dim{raised}",
                rows.join(", ")
            )
        }
        (false, true) => "one call per sample".to_string(),
    };
    println!("batching: {batching}");
    println!("\n{}", entry.op.doc());
    Ok(())
}

/// Runs one op at one dtype; returns whether it passed.
fn run_one(op: &str, dtype: DType, args: &RunArgs) -> Result<bool> {
    let entry = Registry::global().get(op)?;
    let shape = args.shape.as_deref().map(parse_shape).transpose()?;
    let mut example = entry.op.example(shape.as_deref(), dtype)?;
    for a in &args.attrs {
        example.attrs.push(parse_attr(a)?);
    }
    let describe_inputs: Vec<String> = example
        .inputs
        .iter()
        .map(|m| {
            m.as_ref().map_or("None".to_string(), |m| {
                format!("{}{}", m.dtype.short_name(), uniop::layout::ShapeDisplay(m.shape()))
            })
        })
        .collect();
    let mut h = OpHarness::new(entry, example, args.seed)?;
    let stream = Stream::default_stream();
    let first = h.run(stream)?;
    let report = h.check()?;
    let best = h.bench(stream, args.iters)?;
    let gbs = h.bytes_moved()? as f64 / best.as_secs_f64() / 1e9;
    println!(
        "{op} {} inputs ({}): {} | first call {:.3} ms, best of {} {:.3} ms, {:.1} GB/s",
        dtype.name(),
        describe_inputs.join(", "),
        if report.pass() { "PASS" } else { "FAIL" },
        first.as_secs_f64() * 1e3,
        args.iters,
        best.as_secs_f64() * 1e3,
        gbs
    );
    print!("{report}");
    Ok(report.pass())
}

fn run(args: &RunArgs) -> Result<bool> {
    let ops: Vec<String> = if args.op == "all" {
        Registry::global().list().iter().map(|e| e.name().to_string()).collect()
    } else {
        vec![args.op.clone()]
    };
    let mut all_pass = true;
    for op in &ops {
        let entry = Registry::global().get(op)?;
        let dtypes: Vec<DType> = match &args.dtype {
            Some(d) => vec![DType::parse(d)?],
            None if args.op == "all" => entry.op.dtypes().to_vec(),
            None => vec![DType::F32],
        };
        for dtype in dtypes {
            all_pass &= run_one(op, dtype, args)?;
        }
    }
    Ok(all_pass)
}

fn main() -> ExitCode {
    // Like other Unix tools, end quietly when the reader of our output goes away (`| head`)
    // instead of panicking on a failed print.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    uniop_ops::init();
    let cli = Cli::parse();
    let loaded = cli.plugins.iter().try_for_each(|path| uniop::plugin::load(path).map(drop));
    let result = loaded.and_then(|()| match &cli.command {
        Command::List => {
            list();
            Ok(true)
        }
        Command::Describe { op } => describe(op).map(|_| true),
        Command::Run(args) => run(args),
        Command::Profile(args) => profile(args),
        Command::Bench(args) => bench::run(args).map(|_| true),
        Command::Demo => demo::run().map(|_| true),
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("uniop: FAILED: an output differs from its reference beyond tolerance");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("uniop: error {e}");
            ExitCode::from(2)
        }
    }
}
