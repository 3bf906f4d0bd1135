//! Every registered op at shapes drawn at random from the sizes where kernels change path — vector
//! widths and their neighbours (1, 7, 8, 9, 15, 16, 17, …), block and tile edges, now and then 0 —
//! with each input and output laid out at random (contiguous, padded rows, every other element, the
//! last two dims swapped, or — inputs the op only reads — the first dim repeated by a zero stride),
//! its flags, modes, scales and `dim`/`batch_dims` drawn at random too, and its optional tensors
//! now and then left out, checked against the op's f64 reference. A combination the op refuses with
//! an error is skipped (counted, so a sweep that only meets refusals fails); a kernel that panics
//! or a value off the reference fails. `registry_ops.rs` runs a few fixed shapes; this one searches
//! the corners between them. Each case runs twice: the second run must write the same bits (the ops
//! are deterministic). After a differentiable op's case, its backward runs as autograd would call
//! it (wired by `uniop::autograd`): on random gradients, at random layouts, and on that call's own
//! arguments, attributes and returns, so a drawn scale reaches the backward with the `lse` it made.
//! The sweep runs twice: as the process sets itself up, and in a child process that runs small
//! tensors the way large ones run — every output streamed past the cache
//! (`UNIOP_STREAMING_THRESHOLD=0`) and every launch split into as many blocks as the pool balances
//! (`UNIOP_MIN_BLOCK_BYTES=1`, on three threads) — so the non-temporal store paths and the block
//! boundaries meet the sweep's odd lengths, offsets and strides, which tensors past the cache's
//! size reach in use but rarely in tests. `UNIOP_SWEEP_CASES` sets the cases per op and dtype (a
//! longer search than CI's), `UNIOP_SWEEP_SEED` the first seed.

use std::sync::Arc;
use uniop::autograd::{BackwardWiring, Source};
use uniop::schema::BaseType;
use uniop::verify::{fill_random, in_place_positions, random_inputs, OpHarness, Rng};
use uniop::{AttrValue, DType, Layout, OpEntry, Registry, Stream, Tensor, TensorMeta};

/// Sizes at which a kernel may switch path: around the 8- and 16-lane vector widths, 32- and
/// 64-wide tiles, cache lines of halves, and a few odd ones.
const SIZES: &[usize] =
    &[1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 47, 48, 63, 64, 65, 96, 127, 128, 129, 255, 257];

/// Elements a case's main shape may hold (keeps the f64 references quick).
const MAX_ELEMENTS: usize = 1 << 15;

/// Elements all of a case's inputs may hold.
const MAX_INPUT_ELEMENTS: usize = 1 << 21;

/// How a tensor is laid out in a case.
#[derive(Clone, Copy, Debug)]
enum Form {
    Contiguous,
    /// `pad` unused elements after each row.
    Padded(usize),
    /// Every other element of the innermost dim.
    EveryOther,
    /// Row-major in the last two dims swapped (a transposed view).
    Swapped,
    /// The first dim repeated by a zero stride (torch's `expand`): inputs the op only reads.
    Expanded,
}

impl Form {
    fn draw(rng: &mut Rng) -> Form {
        match rng.next_u64() % 6 {
            0 | 1 => Form::Contiguous,
            2 => Form::Padded(1 + (rng.next_u64() % 7) as usize),
            3 => Form::EveryOther,
            4 => Form::Swapped,
            _ => Form::Expanded,
        }
    }

    fn apply(self, meta: &TensorMeta) -> TensorMeta {
        let shape = meta.shape();
        let rank = shape.len();
        let mut order: Vec<usize> = (0..rank).collect();
        if let Form::Swapped = self {
            if rank >= 2 {
                order.swap(rank - 1, rank - 2);
            }
        }
        let mut strides = vec![0; rank];
        let mut acc = if let Form::EveryOther = self { 2 } else { 1 };
        for (i, &d) in order.iter().enumerate().rev() {
            strides[d] = acc;
            acc *= shape[d].max(1);
            if let (Form::Padded(pad), true) = (self, i == rank - 1) {
                acc += pad;
            }
        }
        // Rows repeated, never a row's own elements (a constant row is a norm's worst conditioning).
        if let (Form::Expanded, true) = (self, rank >= 2) {
            strides[0] = 0;
        }
        TensorMeta { dtype: meta.dtype, layout: Layout::strided(shape, &strides, 1).unwrap() }
    }
}

/// Row lengths past the small sizes: wide rows split into chunks, blocks and tiles.
const WIDE: &[usize] = &[1000, 1023, 1025, 2047, 4097];

fn draw_shape(rng: &mut Rng) -> Vec<usize> {
    // One case in ten: a few wide rows.
    if pick(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], rng) == 0 {
        return vec![pick(&[1, 2, 3, 5], rng), pick(WIDE, rng)];
    }
    let mut shape = loop {
        let rank = pick(&[1, 2, 3, 4], rng);
        let shape: Vec<usize> = (0..rank).map(|_| pick(SIZES, rng)).collect();
        if shape.iter().product::<usize>() <= MAX_ELEMENTS {
            break shape;
        }
    };
    // One case in sixteen: a dim of 0 (no rows, an empty batch, empty rows). Nothing is read, yet
    // a sum over the missing rows (a weight's gradient) must still be written: as zeros.
    if rng.next_u64().is_multiple_of(16) {
        let rank = shape.len();
        shape[(rng.next_u64() % rank as u64) as usize] = 0;
    }
    shape
}

/// The values string attributes take across the registry (an op refuses the ones it lacks).
const STR_VALUES: &[(&str, &[&str])] = &[("mode", &["half", "interleave"]), ("approximate", &["none", "tanh"])];

/// Index-valued attributes, drawn among the first indices the examples' index inputs hold (an
/// ignored target, a padding row) or, for `top_k`, a few cut-offs.
const INT_VALUES: &[(&str, &[i64])] =
    &[("ignore_index", &[-100, 0, 1, 2]), ("padding_idx", &[-1, 0, 1, 2]), ("top_k", &[0, 1, 5])];

fn pick<T: Copy>(values: &[T], rng: &mut Rng) -> T {
    values[(rng.next_u64() % values.len() as u64) as usize]
}

/// The example's attributes with each flag, string, float and index drawn at random, and `dim` /
/// `batch_dims` drawn within the main input's rank.
///
/// Floats are drawn for forward ops only: a backward's saved inputs (`out`, `lse`) are random here,
/// not what the forward made, so a larger attention scale makes its true gradients overflow — a
/// case no forward call can produce. The backward run after each forward case (`backward_case`)
/// takes that call's drawn floats.
fn draw_attrs(
    entry: &uniop::OpEntry,
    example: &uniop::Example,
    rank: usize,
    is_backward: bool,
    rng: &mut Rng,
) -> Vec<(String, AttrValue)> {
    let mut attrs = example.attrs.clone();
    for arg in entry.schema.attrs() {
        let given = attrs.iter().find(|(name, _)| name == &arg.name).map(|(_, v)| v).or(arg.default.as_ref());
        let value = match (arg.ty.base, arg.name.as_str()) {
            (BaseType::Bool, _) => AttrValue::Bool(rng.next_u64().is_multiple_of(2)),
            (BaseType::Int, "dim") => AttrValue::Int((rng.next_u64() % (2 * rank as u64 + 1)) as i64 - rank as i64),
            (BaseType::Int, "batch_dims") => AttrValue::Int((rng.next_u64() % rank as u64) as i64),
            (BaseType::Str, name) => match STR_VALUES.iter().find(|(attr, _)| *attr == name) {
                Some((_, values)) => AttrValue::Str(pick(values, rng).into()),
                None => continue,
            },
            (BaseType::Int, name) => match INT_VALUES.iter().find(|(attr, _)| *attr == name) {
                Some((_, values)) => AttrValue::Int(pick(values, rng)),
                None => continue,
            },
            // A scale, softcap or epsilon halved or doubled (`None` for one left out, or a
            // softcap set where the example has none).
            (BaseType::Float, _) if !is_backward => match given {
                _ if arg.ty.optional && rng.next_u64().is_multiple_of(3) => AttrValue::None,
                Some(AttrValue::Float(v)) => AttrValue::Float(v * pick(&[0.5, 2.0], rng)),
                _ => AttrValue::Float(pick(&[0.5, 2.0, 30.0], rng)),
            },
            _ => continue,
        };
        if rng.next_u64().is_multiple_of(2) {
            attrs.retain(|(name, _)| name != &arg.name);
            attrs.push((arg.name.clone(), value));
        }
    }
    attrs
}

/// Leaves out, one time in three, each optional tensor the example gives (a bias, a mask, a
/// second operand), so the paths without it run too.
fn drop_optional_inputs(entry: &uniop::OpEntry, example: &mut uniop::Example, rng: &mut Rng) {
    let mut at = 0;
    for (arg, count) in entry.schema.tensor_args(example.inputs.len(), true) {
        if arg.ty.optional && rng.next_u64().is_multiple_of(3) {
            if let Some(slot) = example.inputs.get_mut(at) {
                *slot = None;
            }
        }
        at += count;
    }
}

/// Layouts drawn for a case's returns, in turn (attention_backward has five).
const OUTPUT_FORMS: usize = 3;

/// A layout for each return an op writes: one of [`OUTPUT_FORMS`] drawn forms, in turn (a
/// return never repeats its elements).
fn output_layouts(rng: &mut Rng) -> impl Fn(&TensorMeta) -> TensorMeta {
    let forms: Vec<Form> = (0..OUTPUT_FORMS)
        .map(|_| match Form::draw(rng) {
            Form::Expanded => Form::Contiguous,
            form => form,
        })
        .collect();
    let next = std::cell::Cell::new(0);
    move |m: &TensorMeta| forms[next.replace(next.get() + 1) % OUTPUT_FORMS].apply(m)
}

/// One drawn call of an op, ready to run and check.
struct Case {
    harness: OpHarness,
    /// What a failure report names: op, dtype, shape, attributes, layouts, seed.
    described: String,
    /// Whether an input repeats its rows (one may; see [`draw_case`]).
    expanded: bool,
}

/// Draws a call of `entry` on `dtype`: a shape, its example's inputs laid out at random, its
/// attributes. `None` for a shape the op cannot build its example on (an odd head dim for rope)
/// or too large a reference; `Some(Err)` for a drawn combination the op refuses.
fn draw_case(
    entry: &Arc<OpEntry>,
    dtype: DType,
    seed: u64,
    is_backward: bool,
    rng: &mut Rng,
) -> Option<Result<Case, uniop::Error>> {
    let shape = draw_shape(rng);
    let mut example = entry.op.example(Some(&shape), dtype).ok()?;
    drop_optional_inputs(entry, &mut example, rng);
    // Wide rows make square weights ([4097, 4097] for a linear): too slow a reference.
    if example.inputs.iter().flatten().map(TensorMeta::numel).sum::<usize>() > MAX_INPUT_ELEMENTS {
        return None;
    }
    let mut forms: Vec<Form> = (0..example.inputs.len()).map(|_| Form::draw(rng)).collect();
    // A tensor the op writes in place cannot repeat its elements (the op refuses it).
    for i in in_place_positions(entry, example.inputs.len()) {
        if let Form::Expanded = forms[i] {
            forms[i] = Form::Contiguous;
        }
    }
    // One input at most repeats its rows. With two (a gradient and the activation it multiplies)
    // every row's half-type rounding is the same, and a sum over the rows (a weight's gradient)
    // gathers it linearly where the √rows tolerance expects independent errors: f16
    // `linear_silu_mul_backward`, 258 identical rows, 0.56 off.
    let mut expanded = forms.iter_mut().filter(|f| matches!(f, Form::Expanded));
    let any_expanded = expanded.next().is_some();
    expanded.for_each(|f| *f = Form::Contiguous);
    let out_layout = output_layouts(rng);
    // random_inputs lays out the inputs given (not the absent optional ones) in order.
    let given: Vec<usize> = (0..example.inputs.len()).filter(|&i| example.inputs[i].is_some()).collect();
    let next = std::cell::Cell::new(0);
    let inputs = random_inputs(&example, seed, |m| forms[given[next.replace(next.get() + 1)]].apply(m));
    let attrs = draw_attrs(entry, &example, shape.len(), is_backward, rng);
    let described = format!("{} {dtype} shape {shape:?} attrs {attrs:?} forms {forms:?} seed {seed}", entry.name());
    let inputs = inputs.unwrap_or_else(|e| panic!("{described}: {e}"));
    let harness = OpHarness::with_inputs(entry.clone(), inputs, attrs, out_layout);
    Some(harness.map(|harness| Case { harness, described, expanded: any_expanded }))
}

/// The call autograd makes after `forward` ran: `backward` (wired to it by `wiring`) on
/// gradients drawn at random for the forward's float returns, laid out at random, and on the
/// forward's own arguments, attributes and returns — what the backward sees in training, so a
/// forward's drawn scale or softcap reaches it with the `lse` that scale made. `None` where a
/// gradient would belong to a non-float return (autograd has none: `cast` to an integer).
fn backward_case(
    forward: &Case,
    backward: &Arc<OpEntry>,
    wiring: &BackwardWiring,
    rng: &mut Rng,
) -> Option<Result<Case, uniop::Error>> {
    let fwd = &forward.harness;
    let schema = &fwd.entry.schema;
    // Each forward argument's slots among the flat tensors (a list's items; none for an attribute).
    let mut slots = vec![0..0; schema.args.len()];
    let tensor_args = schema.args.iter().enumerate().filter(|(_, a)| a.ty.is_tensor()).map(|(i, _)| i);
    let mut at = 0;
    for (i, (_, count)) in tensor_args.zip(schema.tensor_args(fwd.inputs.len(), true)) {
        slots[i] = at..at + count;
        at += count;
    }
    let returned = |i: usize| &fwd.outputs[schema.mutated().count() + i];
    let forward_attr = |name: &str| {
        let given = fwd.attrs.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        given.or_else(|| schema.args.iter().find(|a| a.name == name)?.default.clone())
    };
    let copy = |t: &Tensor| Tensor::copy_of(&t.view()).expect("a copy of a tensor that exists");
    let mut expanded = forward.expanded;
    let (mut inputs, mut attrs, mut drawn) = (Vec::new(), Vec::new(), Vec::new());
    for (arg, &source) in backward.schema.args.iter().zip(&wiring.sources) {
        match (source, arg.ty.is_tensor()) {
            (Source::Grad(i), true) => {
                let out = returned(i);
                if !out.dtype().is_float() {
                    return None;
                }
                let form = match Form::draw(rng) {
                    Form::Expanded if std::mem::replace(&mut expanded, true) => Form::Contiguous,
                    form => form,
                };
                let mut grad = Tensor::with_meta(form.apply(out.meta())).expect("a gradient's layout");
                fill_random(&mut grad.view_mut(), rng);
                inputs.push(Some(grad));
                drawn.push(format!("{}: {form:?}", arg.name));
            }
            (Source::Arg(i), true) => inputs.extend(fwd.inputs[slots[i].clone()].iter().map(|t| t.as_ref().map(copy))),
            (Source::Out(i), true) => inputs.push(Some(copy(returned(i)))),
            (Source::Default, true) => inputs.push(None),
            (Source::Arg(i), false) => {
                if let Some(value) = forward_attr(&schema.args[i].name) {
                    attrs.push((arg.name.clone(), value));
                }
            }
            (Source::NeedsGrad(i), false) => {
                // A caller wants a gradient of a tensor it gave, or not.
                let given = slots[i].clone().any(|s| fwd.inputs[s].is_some());
                let needs = given && !rng.next_u64().is_multiple_of(3);
                attrs.push((arg.name.clone(), AttrValue::Bool(needs)));
                drawn.push(format!("{}: {needs}", arg.name));
            }
            _ => {}
        }
    }
    let described = format!("{} after {}, {}", backward.name(), forward.described, drawn.join(", "));
    let harness = OpHarness::with_inputs(backward.clone(), inputs, attrs, output_layouts(rng));
    Some(harness.map(|harness| Case { harness, described, expanded }))
}

/// Runs a case and checks it against the reference, then runs it again: the ops are
/// deterministic, so the second run must write the same bits. Returns whether the outputs hold
/// the op's results (a backward case may then build on them).
fn run_and_check(case: &mut Case, failures: &mut Vec<String>) -> bool {
    let Case { harness: h, described, .. } = case;
    let checked = match h.run(Stream::default_stream()).and_then(|_| h.check()) {
        Ok(report) if report.pass() => true,
        Ok(report) => {
            failures.push(format!("{described}:\n{report}"));
            false
        }
        Err(e) => {
            failures.push(format!("{described}: {e}"));
            false
        }
    };
    let first = written_bytes(h);
    match h.run(Stream::default_stream()) {
        Ok(_) if written_bytes(h) == first => {}
        Ok(_) => failures.push(format!("{described}: a second run wrote other values")),
        Err(e) => failures.push(format!("{described}: second run: {e}")),
    }
    checked
}

/// The storage bytes of every tensor the harness's op writes.
fn written_bytes(h: &OpHarness) -> Vec<Vec<u8>> {
    // SAFETY: runs are synchronous; nothing writes the outputs while they are read.
    h.outputs.iter().map(|t| unsafe { t.buffer().as_slice() }.to_vec()).collect()
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn random_shapes_and_layouts_match_reference() {
    uniop_ops::init();
    let cases = env_u64("UNIOP_SWEEP_CASES", 20);
    let first_seed = env_u64("UNIOP_SWEEP_SEED", 1);
    let registry = Registry::global();
    let mut failures = Vec::new();
    let (mut ran, mut refused, mut ran_backward) = (0, 0, 0);
    let backward_ops: Vec<&str> = registry.list().iter().filter_map(|e| e.op.backward()).collect();
    for entry in registry.list() {
        let backward = registry.backward_of(&entry).unwrap_or_else(|e| panic!("{e}"));
        let is_backward = backward_ops.contains(&entry.name());
        for &dtype in entry.op.dtypes() {
            for case in 0..cases {
                let seed = first_seed.wrapping_mul(1_000_003).wrapping_add(case);
                let mut rng = Rng::new(seed ^ entry.name().len() as u64 ^ (dtype as u64) << 32);
                let mut forward = match draw_case(&entry, dtype, seed, is_backward, &mut rng) {
                    None => continue,
                    // A drawn attribute, or a tensor left out, that the op does not take with these inputs.
                    Some(Err(_)) => {
                        refused += 1;
                        continue;
                    }
                    Some(Ok(case)) => case,
                };
                ran += 1;
                if !run_and_check(&mut forward, &mut failures) {
                    continue;
                }
                let Some((backward, wiring)) = &backward else { continue };
                if !backward.op.dtypes().contains(&dtype) {
                    continue;
                }
                // Whatever a forward call made, its backward takes: a refusal is a failure.
                match backward_case(&forward, backward, wiring, &mut rng) {
                    None => {}
                    Some(Ok(mut case)) => {
                        ran_backward += 1;
                        run_and_check(&mut case, &mut failures);
                    }
                    Some(Err(e)) => failures.push(format!("{} after {}: {e}", backward.name(), forward.described)),
                }
            }
        }
    }
    eprintln!("{ran} cases run ({ran_backward} more as backward after a forward), {refused} refused");
    assert!(ran > 4 * refused, "{refused} refused against {ran} run: the sweep draws too few valid cases");
    assert!(ran_backward > ran / 4, "only {ran_backward} backward cases after {ran} forward ones");
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), ran + ran_backward, failures.join("\n"));
}

/// The settings are read once per process, so this sweep runs in a child: this test binary running
/// only the sweep above.
#[test]
fn streamed_and_split_like_large_tensors_match_reference() {
    let exe = std::env::current_exe().unwrap();
    let child = std::process::Command::new(exe)
        .args(["--exact", "random_shapes_and_layouts_match_reference", "--nocapture"])
        .envs([("UNIOP_STREAMING_THRESHOLD", "0"), ("UNIOP_MIN_BLOCK_BYTES", "1"), ("UNIOP_NUM_THREADS", "3")])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&child.stdout), String::from_utf8_lossy(&child.stderr));
    assert!(child.status.success(), "the sweep run as large tensors run failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "the child ran no sweep:\n{stdout}");
    eprintln!("streamed and split: {}", stderr.trim());
}
