//! Every registered op through the C ABI's by-name call with one thing made wrong at a time: each
//! input absent, of another dtype, rank or size, or broadcast; each output of another dtype or
//! shape, strided, self-overlapping or laid over an input; too few or too many tensors; each
//! attribute given a value of every kind; a workspace one byte short; a consumed executor.
//!
//! The contract it holds every op to, generically (a new op is swept the moment it registers):
//! a call returns `UNIOP_SUCCESS` or a documented error code — never `UNIOP_ERROR_INTERNAL`,
//! which is a caught panic — with a message naming the op or the C function; a call that plans
//! must launch; no call writes a byte outside the output tensors it was given (every buffer lies
//! between guard bytes, and inputs are compared byte for byte after the launch). The C programs in
//! `examples/c` check chosen misuses by their exact messages; this checks the same rules
//! everywhere. Buffers start element-aligned but not 8-byte aligned, as C callers may pass them.

use crate::*;
use std::ffi::{CStr, CString};
use std::sync::Arc;
use uniop::schema::BaseType;
use uniop::verify::{in_place_positions, infer, random_inputs, tolerance};
use uniop::{DType, Layout, OpEntry, Registry, TensorMeta, TensorRef};

/// Guard bytes on each side of every buffer.
const GUARD: usize = 64;
const CANARY: u8 = 0xA5;

/// Caller memory for one tensor's storage, between guard bytes.
struct Buffer {
    words: Vec<u64>,
    start: usize,
    len: usize,
}

impl Buffer {
    /// A storage of `len` bytes of `elem`-byte elements holding `init` as far as each goes (zeros
    /// past its end).
    fn new(len: usize, elem: usize, init: &[u8]) -> Buffer {
        let start = GUARD + elem % 8;
        let mut b = Buffer { words: vec![0; (start + len + GUARD).div_ceil(8)], start, len };
        b.bytes_mut().fill(CANARY);
        let data = b.data_mut();
        data.fill(0);
        let n = init.len().min(len);
        data[..n].copy_from_slice(&init[..n]);
        b
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the words' memory read as bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.words.len() * 8) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.words.len() * 8) }
    }

    fn data(&self) -> &[u8] {
        &self.bytes()[self.start..self.start + self.len]
    }

    fn data_mut(&mut self) -> &mut [u8] {
        let (start, len) = (self.start, self.len);
        &mut self.bytes_mut()[start..start + len]
    }

    fn guards_intact(&self) -> bool {
        let b = self.bytes();
        b[..self.start].iter().chain(&b[self.start + self.len..]).all(|&x| x == CANARY)
    }
}

/// One tensor argument: its meta and the starting bytes of its storage (zeros when short).
#[derive(Clone)]
struct Arg {
    meta: TensorMeta,
    init: Vec<u8>,
}

impl Arg {
    fn zeros(meta: TensorMeta) -> Arg {
        Arg { meta, init: Vec::new() }
    }

    fn storage_bytes(&self) -> usize {
        let extent = if self.meta.numel() == 0 { 0 } else { self.meta.layout.storage_extent().unwrap() };
        extent * self.meta.dtype.size()
    }
}

/// A by-name call: inputs (None: passed as NULL), attributes, outputs, and optionally one output
/// described over another input's memory.
#[derive(Clone)]
struct Call {
    inputs: Vec<Option<Arg>>,
    attrs: String,
    outputs: Vec<Arg>,
    output_over_input: Option<(usize, usize)>,
}

/// What a call did: its outputs' storage after the launch, or the error it returned.
enum Outcome {
    Ran(Vec<Vec<u8>>),
    Refused,
}

struct Sweep {
    op: String,
    failures: Vec<String>,
}

fn code_of(dtype: DType) -> uniopDataType {
    crate::tensor::DTYPE_CODES.iter().find(|(_, d)| *d == dtype).expect("every dtype has a UNIOP_* code").0
}

fn describe(meta: &TensorMeta, data: *mut u8, storage_bytes: usize) -> *mut uniopTensor {
    let dims: Vec<i64> = meta.shape().iter().map(|&d| d as i64).collect();
    let strides: Vec<i64> = meta.layout.strides().iter().map(|&s| s as i64).collect();
    let storage = [(storage_bytes / meta.dtype.size()) as i64];
    let t = uniopCreateTensor(
        dims.as_ptr(),
        dims.len() as u64,
        code_of(meta.dtype),
        strides.as_ptr(),
        meta.layout.offset() as i64,
        UNIOP_FORMAT_ND,
        storage.as_ptr(),
        1,
        data as *mut std::ffi::c_void,
    );
    assert!(!t.is_null(), "describing {meta:?}: {}", recent_message());
    t
}

fn recent_message() -> String {
    // SAFETY: the library returns a NUL-terminated string valid until this thread's next failure.
    unsafe { CStr::from_ptr(uniopGetRecentErrMsg()) }.to_string_lossy().into_owned()
}

const ERROR_CODES: [uniopStatus; 6] = [
    UNIOP_ERROR_PARAM_NULLPTR,
    UNIOP_ERROR_PARAM_INVALID,
    UNIOP_ERROR_DTYPE,
    UNIOP_ERROR_SHAPE,
    UNIOP_ERROR_WORKSPACE_TOO_SMALL,
    UNIOP_ERROR_RUNTIME,
];

impl Sweep {
    fn fail(&mut self, case: &str, what: String) {
        self.failures.push(format!("{} [{case}]: {what}", self.op));
    }

    /// Whether the call succeeded; an error status that breaks the contract is recorded.
    fn status_ok(&mut self, case: &str, func: &str, status: uniopStatus) -> bool {
        if status == UNIOP_SUCCESS {
            return true;
        }
        let message = recent_message();
        if !ERROR_CODES.contains(&status) {
            self.fail(case, format!("{func} returned {status}: {message}"));
        } else if !message.contains(&self.op) && !message.contains(func) {
            self.fail(case, format!("{func} returned {status} with a message naming neither: {message:?}"));
        }
        false
    }

    fn run(&mut self, case: &str, call: &Call) -> Outcome {
        let mut in_bufs: Vec<Option<Buffer>> = call
            .inputs
            .iter()
            .map(|a| a.as_ref().map(|a| Buffer::new(a.storage_bytes(), a.meta.dtype.size(), &a.init)))
            .collect();
        let mut out_bufs: Vec<Buffer> =
            call.outputs.iter().map(|a| Buffer::new(a.storage_bytes(), a.meta.dtype.size(), &a.init)).collect();
        let before: Vec<Option<Vec<u8>>> = in_bufs.iter().map(|b| b.as_ref().map(|b| b.data().to_vec())).collect();
        let mut handles = Vec::new();
        let ins: Vec<*const uniopTensor> = call
            .inputs
            .iter()
            .zip(&mut in_bufs)
            .map(|(a, b)| match (a, b) {
                (Some(a), Some(b)) => {
                    let t = describe(&a.meta, b.data_mut().as_mut_ptr(), b.len);
                    handles.push(t);
                    t as *const uniopTensor
                }
                _ => std::ptr::null(),
            })
            .collect();
        let mut outs = Vec::new();
        for (o, (a, b)) in call.outputs.iter().zip(&mut out_bufs).enumerate() {
            let t = match call.output_over_input {
                Some((oo, i)) if oo == o => {
                    let b = in_bufs[i].as_mut().expect("laid over a present input");
                    describe(&a.meta, b.data_mut().as_mut_ptr(), b.len)
                }
                _ => describe(&a.meta, b.data_mut().as_mut_ptr(), b.len),
            };
            handles.push(t);
            outs.push(t as *const uniopTensor);
        }
        let ran = self.plan_and_launch(case, call, &ins, &outs);
        for t in handles {
            assert_eq!(uniopDestroyTensor(t), UNIOP_SUCCESS);
        }
        let written_input = call.output_over_input.map(|(_, i)| i);
        for (i, (b, before)) in in_bufs.iter().zip(&before).enumerate() {
            let (Some(b), Some(before)) = (b, before) else { continue };
            if !b.guards_intact() {
                self.fail(case, format!("wrote outside input {i}'s storage"));
            } else if written_input != Some(i) && b.data() != &before[..] {
                self.fail(case, format!("changed input {i}"));
            }
        }
        for (o, b) in out_bufs.iter().enumerate() {
            if !b.guards_intact() {
                self.fail(case, format!("wrote outside output {o}'s storage"));
            }
        }
        if ran {
            Outcome::Ran(out_bufs.iter().map(|b| b.data().to_vec()).collect())
        } else {
            Outcome::Refused
        }
    }

    /// Both phases, with a short workspace first and a second launch of the consumed executor
    /// after; whether the call ran.
    fn plan_and_launch(
        &mut self,
        case: &str,
        call: &Call,
        ins: &[*const uniopTensor],
        outs: &[*const uniopTensor],
    ) -> bool {
        let op = CString::new(self.op.clone()).unwrap();
        let attrs = CString::new(call.attrs.clone()).unwrap();
        let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
        let status = uniopOpGetWorkspaceSize(
            op.as_ptr(),
            ins.as_ptr(),
            ins.len() as u64,
            attrs.as_ptr(),
            outs.as_ptr(),
            outs.len() as u64,
            &mut ws,
            &mut exec,
        );
        if !self.status_ok(case, "uniopOpGetWorkspaceSize", status) {
            return false;
        }
        let mut workspace = Buffer::new(ws as usize, 1, &[]);
        if ws > 0 {
            let short = uniopOpRun(workspace.data_mut().as_mut_ptr().cast(), ws - 1, exec, std::ptr::null_mut());
            if short != UNIOP_ERROR_WORKSPACE_TOO_SMALL {
                self.fail(case, format!("a workspace one byte short gave status {short}: {}", recent_message()));
            }
        }
        let launched = uniopOpRun(workspace.data_mut().as_mut_ptr().cast(), ws, exec, std::ptr::null_mut());
        let ran = self.status_ok(case, "uniopOpRun", launched)
            && self.status_ok(case, "uniopSynchronizeStream", uniopSynchronizeStream(std::ptr::null_mut()));
        if ran {
            let again = uniopOpRun(workspace.data_mut().as_mut_ptr().cast(), ws, exec, std::ptr::null_mut());
            if again != UNIOP_ERROR_PARAM_INVALID {
                self.fail(case, format!("a consumed executor launched again gave status {again}"));
            }
        } else {
            assert_eq!(uniopDestroyExecutor(exec), UNIOP_SUCCESS);
        }
        if !workspace.guards_intact() {
            self.fail(case, "wrote outside the workspace".into());
        }
        ran
    }

    /// A call that must be refused.
    fn refused(&mut self, case: &str, call: &Call) {
        if let Outcome::Ran(_) = self.run(case, call) {
            self.fail(case, "ran; expected an error".into());
        }
    }

    /// A call that must run and give `want`'s values.
    fn same_values(&mut self, case: &str, call: &Call, want: &[Vec<u8>], valid: &Call) {
        let Outcome::Ran(got) = self.run(case, call) else {
            return self.fail(case, format!("refused: {}", recent_message()));
        };
        for (o, (g, w)) in got.iter().zip(want).enumerate() {
            let (g, w) = (values(&call.outputs[o].meta, g), values(&valid.outputs[o].meta, w));
            let (atol, rtol) = tolerance(call.outputs[o].meta.dtype);
            let close = |a: f64, b: f64| (a - b).abs() <= atol + rtol * b.abs() || (a.is_nan() && b.is_nan());
            if let Some(k) = g.iter().zip(&w).position(|(&a, &b)| !close(a, b)) {
                self.fail(case, format!("output {o}[{k}] = {}, the contiguous call gave {}", g[k], w[k]));
            }
        }
    }
}

/// The elements of a tensor over `bytes`, in row-major order.
fn values(meta: &TensorMeta, bytes: &[u8]) -> Vec<f64> {
    let aligned = Buffer::new(bytes.len(), 8, bytes);
    TensorRef::from_bytes(aligned.data(), meta.clone()).unwrap().to_f64_vec()
}

/// The example's inputs (random, in their ranges), attributes and outputs, as a valid call.
fn valid_call(entry: &Arc<OpEntry>, dtype: DType) -> Call {
    let example = entry.op.example(Some(&[4, 3, 8]), dtype).unwrap();
    let tensors = random_inputs(&example, 5, |m| m.clone()).unwrap();
    let views: Vec<Option<TensorRef<'_>>> = tensors.iter().map(|t| t.as_ref().map(|t| t.view())).collect();
    let attr_refs = uniop::verify::attr_refs(&example.attrs);
    let returns = infer(entry, &views, &attr_refs).unwrap();
    let arg = |t: &uniop::Tensor| {
        let view = t.view();
        let bytes = t.meta().contiguous_bytes().unwrap();
        // SAFETY: a contiguous tensor's storage is `bytes` long.
        Arg { meta: t.meta().clone(), init: unsafe { std::slice::from_raw_parts(view.as_ptr(), bytes) }.to_vec() }
    };
    let in_place = in_place_positions(entry, tensors.len());
    let mut inputs = Vec::new();
    let mut outputs: Vec<Arg> = in_place.iter().map(|&i| arg(tensors[i].as_ref().unwrap())).collect();
    for (i, t) in tensors.iter().enumerate() {
        if !in_place.contains(&i) {
            inputs.push(t.as_ref().map(arg));
        }
    }
    outputs.extend(returns.into_iter().map(Arg::zeros));
    let attrs: Vec<String> = example.attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    Call { inputs, attrs: attrs.join(", "), outputs, output_over_input: None }
}

/// `meta` with its shape changed by `reshape` (contiguous).
fn reshaped(meta: &TensorMeta, reshape: impl Fn(&mut Vec<usize>)) -> TensorMeta {
    let mut shape = meta.shape().to_vec();
    reshape(&mut shape);
    TensorMeta::contiguous(meta.dtype, &shape).unwrap()
}

/// `meta`'s shape, every row padded by 3 elements and offset by 2.
fn padded(meta: &TensorMeta) -> TensorMeta {
    let shape = meta.shape();
    let mut strides = vec![1; shape.len()];
    let mut acc = 1;
    for d in (0..shape.len()).rev() {
        strides[d] = acc;
        acc *= shape[d].max(1);
        if d + 1 == shape.len() {
            acc += 3;
        }
    }
    TensorMeta { dtype: meta.dtype, layout: Layout::strided(shape, &strides, 2).unwrap() }
}

/// `meta`'s shape with the first dim's stride 0: every index of it the same memory.
fn broadcast_first(meta: &TensorMeta) -> TensorMeta {
    let mut strides = meta.layout.strides().to_vec();
    strides[0] = 0;
    TensorMeta { dtype: meta.dtype, layout: Layout::strided(meta.shape(), &strides, 0).unwrap() }
}

fn other_dtypes(dtype: DType) -> impl Iterator<Item = DType> {
    [DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64, DType::Bool]
        .into_iter()
        .filter(move |&d| d != dtype)
}

/// Every change of a tensor's meta the sweep makes, by name.
fn tensor_changes(meta: &TensorMeta) -> Vec<(String, TensorMeta)> {
    let mut changes: Vec<(String, TensorMeta)> = other_dtypes(meta.dtype)
        .map(|d| (format!("dtype {d}"), TensorMeta::contiguous(d, meta.shape()).unwrap()))
        .collect();
    changes.push(("a leading dim of 1 more".into(), reshaped(meta, |s| s.insert(0, 1))));
    changes.push(("flattened".into(), reshaped(meta, |s| *s = vec![s.iter().product()])));
    if meta.rank() > 0 {
        changes.push(("last dim + 1".into(), reshaped(meta, |s| *s.last_mut().unwrap() += 1)));
        changes.push(("last dim 0".into(), reshaped(meta, |s| *s.last_mut().unwrap() = 0)));
        changes.push(("first dim's stride 0".into(), broadcast_first(meta)));
    }
    changes.push(("padded rows".into(), padded(meta)));
    changes
}

/// Every value an attribute is given in turn.
const ATTR_VALUES: [&str; 9] =
    ["-5", "4611686018427387904", "nan", "inf", "'abc'", "[1, 2]", "None", "True", "float32"];

fn sweep_op(entry: &Arc<OpEntry>, dtype: DType) -> Vec<String> {
    let mut s = Sweep { op: entry.name().to_string(), failures: Vec::new() };
    let valid = valid_call(entry, dtype);
    let Outcome::Ran(want) = s.run("valid", &valid) else {
        return vec![format!("{} {dtype}: the example call was refused: {}", s.op, recent_message())];
    };
    let in_place = entry.schema.mutated().count();
    for i in 0..valid.inputs.len() {
        let mut call = valid.clone();
        if call.inputs[i].take().is_some() {
            s.run(&format!("input {i} NULL"), &call);
        }
        let Some(arg) = &valid.inputs[i] else { continue };
        for (what, meta) in tensor_changes(&arg.meta) {
            let mut call = valid.clone();
            // The same bytes as far as they go: a wider or padded view reads zeros past them.
            call.inputs[i] = Some(Arg { meta, init: arg.init.clone() });
            s.run(&format!("input {i} {what}"), &call);
        }
    }
    for o in 0..valid.outputs.len() {
        let arg = &valid.outputs[o];
        for (what, meta) in tensor_changes(&arg.meta) {
            let mut call = valid.clone();
            call.outputs[o] = Arg { meta: meta.clone(), init: arg.init.clone() };
            let case = format!("output {o} {what}");
            if meta.layout.shape() == arg.meta.shape() && meta.dtype == arg.meta.dtype {
                if meta.layout.strides().first() == Some(&0)
                    && arg.meta.numel() > arg.meta.shape()[1..].iter().product()
                {
                    s.refused(&case, &call);
                } else if o >= in_place {
                    s.same_values(&case, &call, &want, &valid);
                } else {
                    s.run(&case, &call);
                }
            } else {
                s.refused(&case, &call);
            }
        }
        for i in 0..valid.inputs.len() {
            let Some(input) = &valid.inputs[i] else { continue };
            if input.storage_bytes() >= arg.storage_bytes()
                && input.meta.dtype == arg.meta.dtype
                && arg.meta.numel() > 0
            {
                let call = Call { output_over_input: Some((o, i)), ..valid.clone() };
                s.refused(&format!("output {o} over input {i}'s memory"), &call);
            }
        }
    }
    let mut call = valid.clone();
    call.outputs.pop();
    s.refused("one output too few", &call);
    let mut call = valid.clone();
    call.outputs.push(valid.outputs[0].clone());
    s.refused("one output too many", &call);
    // A tensor list takes any count; elsewhere an extra tensor is an error, a missing last one
    // may be an absent optional.
    let mut call = valid.clone();
    call.inputs.push(valid.inputs.iter().flatten().next().cloned());
    if entry.schema.inputs().any(|a| a.ty.base == BaseType::TensorList) {
        s.run("one input too many", &call);
    } else {
        s.refused("one input too many", &call);
    }
    if let Some(last) = valid.inputs.len().checked_sub(1) {
        let mut call = valid.clone();
        call.inputs.truncate(last);
        s.run("one input too few", &call);
    }
    for arg in entry.schema.attrs() {
        for value in ATTR_VALUES {
            let call = Call { attrs: format!("{}, {}={value}", valid.attrs, arg.name), ..valid.clone() };
            s.run(&format!("attribute {}={value}", arg.name), &call);
        }
    }
    for attrs in ["bogus=1", "eps", "=1", "dim=[1, 2"] {
        let call = Call { attrs: attrs.into(), ..valid.clone() };
        s.refused(&format!("attributes {attrs:?}"), &call);
    }
    s.failures
}

#[test]
fn every_op_keeps_the_contract_under_every_misuse() {
    uniop_ops::init();
    let mut failures = Vec::new();
    let mut swept = 0;
    for entry in Registry::global().list() {
        let dtypes = entry.op.dtypes();
        let mut chosen: Vec<DType> = [DType::F32, DType::BF16].into_iter().filter(|d| dtypes.contains(d)).collect();
        if chosen.is_empty() {
            chosen.push(dtypes[0]);
        }
        for dtype in chosen {
            failures.extend(sweep_op(&entry, dtype));
            swept += 1;
        }
    }
    assert!(swept >= 50, "only {swept} op/dtype pairs swept");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
