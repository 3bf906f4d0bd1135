//! The two-phase executor (aclnn's `GetWorkspaceSize` + launch).
//!
//! Phase 1 ([`Executor::new`]) binds tensors and attributes to an op, runs `infer`, checks the
//! caller's outputs against it, lets the op `plan`, and adds staging copies for tensors whose
//! layout the kernel does not accept. The result knows its workspace size. Phase 2 runs the plan
//! on a stream with a caller-provided workspace.
//!
//! Tensors an op writes in place (`Tensor(a!)` in its schema, e.g. a KV cache) are passed with
//! the outputs — first, in declaration order, then the returns — because the caller must hand
//! them over mutably; `inputs` then lists only the tensors the op reads. Kernels reach them
//! through [`KernelArgs::output`], and `OpCx` still shows them as named inputs for validation.
//!
//! Executors are single-use by default; [`Executor::set_repeatable`] allows relaunching, and the
//! `rebind_*` calls swap tensor addresses (same dtype/shape/strides) without planning again.

use crate::error::{Error, ErrorCode, Result};
use crate::layout::{MetaRef, RowTiles, ShapeDisplay, StridedRuns, TensorMeta};
use crate::op::{block_dim_for, reference_plan, Bound, KernelArgs, LayoutNeed, Step};
use crate::registry::{OpEntry, Registry};
use crate::runtime::profiler::{self, LaunchKind};
use crate::runtime::stream::{Launch, LaunchKernel};
use crate::runtime::{BlockCtx, Stream};
use crate::schema::AttrValue;
use crate::tensor::{check_view, TensorMut, TensorRef};
use rustc_hash::FxHashMap;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

const WS_ALIGN: usize = 64;

/// A launch's tasks: most plans are one or two steps with nothing staged, and a tiny op's
/// relaunch should not pay for a heap list.
type Launches = smallvec::SmallVec<[Launch; 2]>;

/// A staging copy around a launch: `(source, destination)`.
type Copy = (Bound, Bound);

/// A tensor whose layout the kernel cannot take: it lives in the workspace for the launch.
#[derive(Clone, Debug)]
struct Staging {
    is_output: bool,
    /// In-place outputs carry the caller's values in, as well as the results out.
    copy_in: bool,
    index: usize,
    /// Byte offset in the (aligned) workspace.
    at: usize,
    meta: TensorMeta,
}

/// What phase 1 derives from metas and attributes alone, shared by every executor planned with
/// the same [`signature`]: validation passed, the plan's steps, and where staging goes.
struct Planned {
    /// Held so that the op's address, which keys the cache, is never reused by another op.
    entry: Arc<OpEntry>,
    steps: Vec<Step>,
    /// Per kernel input slot (schema order), the caller's input index (`None`: in place).
    slots: Vec<Option<usize>>,
    /// Kernel slot of each of the caller's inputs (they skip in-place arguments).
    input_slots: Vec<usize>,
    staging: Vec<Staging>,
    op_workspace: usize,
    workspace_size: usize,
    /// Every task of a launch (staging copies and steps) is one block: see [`Executor::launch`].
    single_block: bool,
    /// Per kernel input slot and per output, the bytes from its pointer that a dense tensor
    /// covers (see [`Executor::check_apart`]); `None` for other layouts.
    dense_inputs: Vec<Option<Range<usize>>>,
    dense_outputs: Vec<Option<Range<usize>>>,
    /// The op's name and its tensors as the profiler shows them (built on the first profiled launch).
    profiled: OnceLock<(Arc<str>, Arc<str>, u64)>,
}

pub struct Executor<'a> {
    planned: Arc<Planned>,
    /// Per kernel input slot (schema order; in-place arguments unbound).
    inputs: Vec<Option<Bound>>,
    outputs: Vec<Bound>,
    repeatable: bool,
    launched: bool,
    /// Kernel bindings of the last launch, reused by the next one when nothing is staged and the
    /// workspace and tensors are the same (a repeatable executor's re-launch allocates nothing).
    bound_args: Option<Arc<KernelArgs>>,
    _life: PhantomData<&'a mut ()>,
}

fn align_up(n: usize) -> usize {
    n.next_multiple_of(WS_ALIGN)
}

impl<'a> Executor<'a> {
    /// Phase 1 by op name through the global registry.
    pub fn by_name(
        op: &str,
        inputs: &[Option<TensorRef<'a>>],
        attrs: &[(&str, AttrValue)],
        outputs: Vec<TensorMut<'a>>,
    ) -> Result<Executor<'a>> {
        Self::new(Registry::global().get(op)?, inputs, attrs, outputs)
    }

    /// Phase 1: validate, infer, plan. `inputs` has one entry per tensor the op reads (flattened
    /// for `Tensor[]`; `None` for an absent `Tensor?`); `outputs` holds the in-place arguments,
    /// then one tensor per return.
    ///
    /// Everything but the addresses depends only on the op, the tensors' dtypes and layouts and
    /// the attributes, so that part is kept per thread and reused by later calls with the same
    /// signature: a model calls the same few shapes over and over, and validating, inferring and
    /// planning again was most of a small op's phase-1 cost.
    pub fn new(
        entry: Arc<OpEntry>,
        inputs: &[Option<TensorRef<'a>>],
        attrs: &[(&str, AttrValue)],
        outputs: Vec<TensorMut<'a>>,
    ) -> Result<Executor<'a>> {
        let mut key = SignatureKey::new();
        let metas = inputs.iter().map(|t| t.as_ref().map(|t| t.meta().as_meta_ref()));
        signature(&entry, metas, attrs, &mut key);
        for t in &outputs {
            meta_words(Some(t.meta().as_meta_ref()), &mut key);
        }
        let planned = match PLANNED.with(|cache| cache.borrow().get(&key).cloned()) {
            Some(planned) => planned,
            None => {
                let planned = Arc::new(plan_call(&entry, inputs, attrs, &outputs)?);
                PLANNED.with(|cache| {
                    let mut cache = cache.borrow_mut();
                    if cache.len() >= CACHED_PLANS {
                        cache.clear();
                    }
                    cache.insert(key, planned.clone());
                });
                planned
            }
        };
        // Kernel input slots follow the schema; in-place arguments are left unbound there.
        let bound_inputs = planned
            .slots
            .iter()
            .map(|slot| {
                let t = inputs[(*slot)?].as_ref()?;
                Some(Bound { ptr: t.as_ptr() as *mut u8, len: t.byte_len(), meta: t.meta().clone() })
            })
            .collect();
        let bound_outputs = outputs
            .into_iter()
            .map(|mut t| Bound { ptr: t.as_mut_ptr(), len: t.byte_len(), meta: t.meta().clone() })
            .collect();
        let exec = Executor {
            planned,
            inputs: bound_inputs,
            outputs: bound_outputs,
            repeatable: false,
            launched: false,
            bound_args: None,
            _life: PhantomData,
        };
        exec.check_apart()?;
        Ok(exec)
    }

    /// Refuses an output sharing memory with an input or another output, for tensors laid out
    /// densely (torch's rule for `out=` tensors; other layouts are not compared). A kernel would
    /// overwrite what it has still to read, or two would race — wrong values, not an error,
    /// without this check. Checked when planning and again at each launch, after any rebinding
    /// (rebinding one tensor at a time may pass through states that overlap).
    fn check_apart(&self) -> Result<()> {
        let span = |ptr: *mut u8, range: &Option<Range<usize>>| {
            range.as_ref().filter(|r| !r.is_empty()).map(|r| ptr as usize + r.start..ptr as usize + r.end)
        };
        let overlap = |a: &Range<usize>, b: &Range<usize>| a.start < b.end && b.start < a.end;
        let planned = &*self.planned;
        for (o, out) in self.outputs.iter().enumerate() {
            let Some(written) = span(out.ptr, &planned.dense_outputs[o]) else { continue };
            // (is an input, its index): named only for the error.
            let read = self
                .inputs
                .iter()
                .zip(&planned.dense_inputs)
                .enumerate()
                .filter_map(|(k, (b, r))| Some(((true, k), span(b.as_ref()?.ptr, r)?)));
            let others = self.outputs[..o]
                .iter()
                .zip(&planned.dense_outputs)
                .enumerate()
                .filter_map(|(p, (b, r))| Some(((false, p), span(b.ptr, r)?)));
            if let Some(((is_input, i), _)) = read.chain(others).find(|(_, r)| overlap(&written, r)) {
                let schema = &planned.entry.schema;
                let name =
                    if is_input { input_name(&planned.entry, i, planned.slots.len()) } else { schema.output_name(i) };
                return Err(Error::arg(
                    ErrorCode::ParamInvalid,
                    self.op(),
                    &schema.output_name(o),
                    "memory of its own",
                    format!("memory shared with '{name}'"),
                ));
            }
        }
        Ok(())
    }

    pub fn op(&self) -> &str {
        self.planned.entry.name()
    }

    /// A kernel's error, prefixed with the op's name unless its message starts with it: a kernel
    /// refusing its data names the op itself (the error may surface at a later `synchronize`,
    /// away from this executor), and twice would read "embedding: embedding: argument ...".
    fn named(&self, e: Error) -> Error {
        let names_op = e.message().strip_prefix(self.op()).is_some_and(|rest| rest.starts_with(": "));
        if names_op {
            e
        } else {
            e.context(self.op())
        }
    }

    /// Bytes of workspace phase 2 needs (0 when none).
    pub fn workspace_size(&self) -> usize {
        self.planned.workspace_size
    }

    /// Allows launching more than once (aclnn's `aclSetAclOpExecutorRepeatable`).
    pub fn set_repeatable(&mut self) {
        self.repeatable = true;
    }

    /// Whether every task of a launch is a single block: work too small to split, which
    /// [`Executor::launch`] runs in place on an idle stream.
    pub fn is_single_block(&self) -> bool {
        self.planned.single_block
    }

    pub fn is_repeatable(&self) -> bool {
        self.repeatable
    }

    /// The meta input `i` (as the caller passed inputs to [`Executor::new`]) was planned with;
    /// `None` for an absent optional input or an index past the inputs.
    pub fn input_meta(&self, i: usize) -> Option<&TensorMeta> {
        self.inputs[*self.planned.input_slots.get(i)?].as_ref().map(|b| &b.meta)
    }

    /// The meta output `i` (in-place tensors first, then returns) was planned with.
    pub fn output_meta(&self, i: usize) -> Option<&TensorMeta> {
        self.outputs.get(i).map(|b| &b.meta)
    }

    /// Points input `i` (the caller's numbering, as in [`Executor::new`]) at new data with the
    /// same dtype, shape and strides.
    pub fn rebind_input(&mut self, i: usize, t: TensorRef<'a>) -> Result<()> {
        let k = self.input_slot(i)?;
        let old = self.inputs[k].as_ref().expect("input_slot checks the slot is bound");
        check_same_layout(self.op(), "input", i, &old.meta, t.meta())?;
        let bound = Bound { ptr: t.as_ptr() as *mut u8, len: t.byte_len(), meta: t.meta().clone() };
        self.patch_bindings(|args| args.inputs[k] = Some(bound.clone()));
        self.inputs[k] = Some(bound);
        Ok(())
    }

    pub fn rebind_output(&mut self, i: usize, mut t: TensorMut<'a>) -> Result<()> {
        self.check_output_index(i)?;
        check_same_layout(self.op(), "output", i, &self.outputs[i].meta, t.meta())?;
        let bound = Bound { ptr: t.as_mut_ptr(), len: t.byte_len(), meta: t.meta().clone() };
        self.patch_bindings(|args| args.outputs[i] = bound.clone());
        self.outputs[i] = bound;
        Ok(())
    }

    /// Points input `i` at new memory holding a tensor laid out as the bound one (same dtype,
    /// shape, strides and offset from `ptr`), checking only that it is aligned and fits `len`
    /// bytes at `ptr`.
    ///
    /// For frontends that cache executors by [`signature`]: on a hit the key already says the
    /// layouts match, so building the [`TensorMeta`] a [`TensorRef`] needs (an allocation) and
    /// the comparison [`Executor::rebind_input`] makes would be wasted — together with the
    /// frontend's own copies, a tenth of a tiny `torch.ops.uniop` call under callgrind.
    ///
    /// # Safety
    /// As for [`TensorRef::from_raw`]: `ptr` is valid for reads of `len` bytes for `'a`.
    pub unsafe fn rebind_input_memory(&mut self, i: usize, ptr: *const u8, len: usize) -> Result<()> {
        let k = self.input_slot(i)?;
        let bound = self.inputs[k].as_mut().expect("input_slot checks the slot is bound");
        check_rebound(bound, ptr, len)
            .map_err(|e| e.context(format!("{}: rebinding input {i}", self.planned.entry.name())))?;
        (bound.ptr, bound.len) = (ptr as *mut u8, len);
        self.patch_bindings(|args| {
            let bound = args.inputs[k].as_mut().expect("bindings mirror the executor's");
            (bound.ptr, bound.len) = (ptr as *mut u8, len);
        });
        Ok(())
    }

    /// [`Executor::rebind_input_memory`] for output `i` (in-place tensors first, then returns).
    ///
    /// # Safety
    /// As for [`TensorMut::from_raw`]: `ptr` is valid for reads and writes of `len` bytes for
    /// `'a`, and nothing else accesses them meanwhile.
    pub unsafe fn rebind_output_memory(&mut self, i: usize, ptr: *mut u8, len: usize) -> Result<()> {
        self.check_output_index(i)?;
        let bound = &mut self.outputs[i];
        check_rebound(bound, ptr, len)
            .map_err(|e| e.context(format!("{}: rebinding output {i}", self.planned.entry.name())))?;
        (bound.ptr, bound.len) = (ptr, len);
        self.patch_bindings(|args| (args.outputs[i].ptr, args.outputs[i].len) = (ptr, len));
        Ok(())
    }

    /// Kernel slot of the caller's input `i`, checked to be bound.
    fn input_slot(&self, i: usize) -> Result<usize> {
        let op = self.op();
        let k = *self
            .planned
            .input_slots
            .get(i)
            .ok_or_else(|| Error::invalid(format!("{op}: rebind_input: no input {i}")))?;
        if self.inputs[k].is_none() {
            return Err(Error::invalid(format!("{op}: rebind_input: input {i} was bound as None")));
        }
        Ok(k)
    }

    fn check_output_index(&self, i: usize) -> Result<()> {
        if i >= self.outputs.len() {
            return Err(Error::invalid(format!("{}: rebind_output: no output {i}", self.op())));
        }
        Ok(())
    }

    /// Applies a rebinding to the kernel bindings kept from the last launch when no queued
    /// launch still holds them (else they are rebuilt at the next launch).
    fn patch_bindings(&mut self, patch: impl FnOnce(&mut KernelArgs)) {
        match self.bound_args.as_mut().and_then(Arc::get_mut) {
            Some(args) if self.planned.staging.is_empty() => patch(args),
            _ => self.bound_args = None,
        }
    }

    /// Phase 2, blocking: runs on `stream` and returns when done, so the borrowed tensors are
    /// never touched after this returns. On an idle stream the work runs right here on the calling
    /// thread (with the compute pool), skipping the hand-off to the stream's worker: that hand-off
    /// is most of a small op's cost and buys nothing when the caller waits anyway.
    pub fn run(&mut self, workspace: &mut [u8], stream: &Stream) -> Result<()> {
        // SAFETY: the tasks run (here, or on the stream while we wait for them) before returning,
        // so all borrows outlive the work.
        let tasks = unsafe { self.prepare(workspace.as_mut_ptr(), workspace.len())? };
        if let Some(result) = stream.run_here_if_idle(&tasks) {
            return result.map_err(|e| self.named(e));
        }
        match enqueue(stream, tasks) {
            Some((first, last)) => stream.wait_through(first, last).map_err(|e| self.named(e)),
            None => Ok(()),
        }
    }

    /// Phase 2, asynchronous: enqueues the plan on `stream` and returns.
    ///
    /// Small work on an idle stream runs right away on the calling thread instead: when every
    /// step is a single block (the op judged it too small to split), handing it to the stream's
    /// worker costs more than running it (a queue lock, a wake-up, a cross-thread free), and
    /// nothing queued can observe the difference — the stream was empty, and the worker takes
    /// nothing until it is done. A kernel failure is then returned here rather than by the next
    /// `synchronize`.
    ///
    /// # Safety
    /// Every bound tensor and the workspace must stay valid (and not be accessed elsewhere) until
    /// `stream` has finished this work — the same contract as an aclnn or CUDA launch.
    pub unsafe fn launch(&mut self, workspace: *mut u8, workspace_len: usize, stream: &Stream) -> Result<()> {
        let tasks = self.prepare(workspace, workspace_len)?;
        if self.planned.single_block {
            if let Some(result) = stream.run_here_if_idle(&tasks) {
                return result.map_err(|e| self.named(e));
            }
        }
        enqueue(stream, tasks);
        Ok(())
    }

    /// Checks a launch and returns its tasks in stream order: staging copies in, the plan's
    /// steps, staging copies out.
    ///
    /// # Safety
    /// As for [`Executor::launch`].
    unsafe fn prepare(&mut self, workspace: *mut u8, workspace_len: usize) -> Result<Launches> {
        let op = self.op();
        if self.launched && !self.repeatable {
            return Err(Error::new(
                ErrorCode::ParamInvalid,
                format!("{op}: this executor was already launched and is single-use (call set_repeatable before the first launch to reuse it)"),
            ));
        }
        if workspace_len < self.planned.workspace_size {
            return Err(Error::new(
                ErrorCode::WorkspaceTooSmall,
                format!(
                    "{op}: workspace of {workspace_len} bytes is smaller than the {} bytes phase 1 asked for",
                    self.planned.workspace_size
                ),
            ));
        }
        if self.planned.workspace_size > 0 && workspace.is_null() {
            return Err(Error::arg(
                ErrorCode::ParamNullptr,
                op,
                "workspace",
                format!("{} bytes", self.planned.workspace_size),
                "a null pointer",
            ));
        }
        self.check_apart()?;
        self.launched = true;
        // With no workspace, staged views are all empty: give them an aligned dangling pointer.
        let base = if self.planned.workspace_size == 0 {
            std::ptr::without_provenance_mut(WS_ALIGN)
        } else {
            workspace.add(workspace.align_offset(WS_ALIGN))
        };

        let reusable = self.planned.staging.is_empty()
            && self
                .bound_args
                .as_ref()
                .is_some_and(|a| a.workspace == base && a.workspace_len == self.planned.op_workspace);
        let (args, copies_in, copies_out) = match &self.bound_args {
            Some(args) if reusable => (args.clone(), Vec::new(), Vec::new()),
            _ => {
                let (args, copies_in, copies_out) = self.bind_for_launch(base);
                self.bound_args = Some(args.clone());
                (args, copies_in, copies_out)
            }
        };
        let op_name = || self.profiled().0.clone();
        let mut tasks: Launches =
            copies_in.into_iter().map(|(src, dst)| copy_task(src, dst, "copy_in", op_name)).collect();
        for step in &self.planned.steps {
            let (args, kernel) = (args.clone(), step.kernel.clone());
            let label = profiler::label(
                op_name,
                step.name,
                LaunchKind::Op,
                || {
                    let (_, signature, bytes) = self.profiled();
                    (signature.clone(), *bytes)
                },
                step.block_dim,
            );
            tasks.push(Launch { block_num: step.block_dim, kernel: LaunchKernel::Step(kernel, args), label });
        }
        tasks.extend(copies_out.into_iter().map(|(src, dst)| copy_task(src, dst, "copy_out", op_name)));
        Ok(tasks)
    }

    /// The op's name, its tensors' description and their bytes, for profiled launches.
    fn profiled(&self) -> &(Arc<str>, Arc<str>, u64) {
        self.planned.profiled.get_or_init(|| {
            let inputs = self.inputs.iter().flatten().map(|b| &b.meta);
            let (signature, bytes) = profiler::describe_tensors(inputs, self.outputs.iter().map(|b| &b.meta));
            (self.op().into(), signature, bytes)
        })
    }

    /// Kernel-facing bindings for a launch with workspace at `base`: staged tensors point into
    /// the workspace, contiguous, with the copies that fill and drain them.
    ///
    /// # Safety
    /// `base` must hold the workspace phase 1 sized.
    unsafe fn bind_for_launch(&self, base: *mut u8) -> (Arc<KernelArgs>, Vec<Copy>, Vec<Copy>) {
        let mut kernel_args = KernelArgs {
            inputs: self.inputs.clone(),
            outputs: self.outputs.clone(),
            workspace: base,
            workspace_len: self.planned.op_workspace,
        };
        let mut copies_in = Vec::new();
        let mut copies_out = Vec::new();
        for s in &self.planned.staging {
            let staged =
                Bound { ptr: base.add(s.at), len: s.meta.contiguous_bytes().unwrap_or(0), meta: s.meta.clone() };
            if s.is_output {
                let user = std::mem::replace(&mut kernel_args.outputs[s.index], staged.clone());
                if s.copy_in {
                    copies_in.push((user.clone(), staged.clone()));
                }
                copies_out.push((staged, user));
            } else {
                let user = kernel_args.inputs[s.index].replace(staged.clone()).expect("staged inputs are bound");
                copies_in.push((user, staged));
            }
        }
        (Arc::new(kernel_args), copies_in, copies_out)
    }
}

/// Phase 1 without the addresses: checks the call and plans it.
fn plan_call(
    entry: &Arc<OpEntry>,
    inputs: &[Option<TensorRef<'_>>],
    attrs: &[(&str, AttrValue)],
    outputs: &[TensorMut<'_>],
) -> Result<Planned> {
    let op = entry.name();
    let in_place = entry.schema.mutated().count();
    if outputs.len() < in_place {
        let names: Vec<_> = entry.schema.mutated().map(|a| a.name.as_str()).collect();
        return Err(Error::new(
            ErrorCode::ParamInvalid,
            format!(
                "{op}: expected the in-place tensors ({}) first among the outputs, got {} outputs",
                names.join(", "),
                outputs.len()
            ),
        ));
    }
    let written: Vec<&TensorMeta> = outputs[..in_place].iter().map(TensorMut::meta).collect();
    let (groups, slots) = group_inputs(entry, inputs, &written)?;
    let cx = entry.bind(groups, attrs)?;
    let expected = entry.infer(&cx)?;
    if outputs.len() != in_place + expected.len() {
        return Err(Error::new(
            ErrorCode::ParamInvalid,
            format!("{op}: expected {} outputs, got {}", in_place + expected.len(), outputs.len()),
        ));
    }
    for (i, (out, want)) in outputs[in_place..].iter().zip(&expected).enumerate() {
        let name = entry.schema.output_name(in_place + i);
        if out.dtype() != want.dtype {
            return Err(Error::arg(ErrorCode::DType, op, &name, format!("dtype {}", want.dtype), out.dtype()));
        }
        if out.shape() != want.shape() {
            return Err(Error::arg(
                ErrorCode::Shape,
                op,
                &name,
                format!("shape {}", want.layout),
                format!("shape {}", out.meta().layout),
            ));
        }
    }
    for (i, out) in outputs.iter().enumerate() {
        let layout = &out.meta().layout;
        if !layout.is_non_overlapping() {
            return Err(Error::arg(
                ErrorCode::ParamInvalid,
                op,
                &entry.schema.output_name(i),
                "a layout in which no two elements share memory",
                format!("shape {} with strides {:?}", ShapeDisplay(layout.shape()), layout.strides()),
            ));
        }
    }
    let plan = if cx.by_reference { reference_plan(entry, &cx, expected.len()) } else { entry.op.plan(&cx)? };
    drop(cx);
    let dense_bytes = |meta: &TensorMeta| {
        let size = meta.dtype.size();
        meta.layout.dense_range().map(|r| r.start * size..r.end * size)
    };
    let dense_inputs =
        slots.iter().map(|slot| slot.and_then(|k| inputs[k].as_ref()).and_then(|t| dense_bytes(t.meta()))).collect();
    let dense_outputs = outputs.iter().map(|t| dense_bytes(t.meta())).collect();

    let mut staging = Vec::new();
    let mut at = align_up(plan.workspace);
    let mut stage = |is_output: bool, index: usize, meta: &TensorMeta, need: LayoutNeed| -> Result<()> {
        if need.satisfied_by(&meta.layout) {
            return Ok(());
        }
        let packed = TensorMeta::contiguous(meta.dtype, meta.shape())?;
        let copy_in = is_output && index < in_place;
        staging.push(Staging { is_output, copy_in, index, at, meta: packed.clone() });
        at = at
            .checked_add(align_up(packed.contiguous_bytes()?))
            .ok_or_else(|| Error::new(ErrorCode::Shape, format!("{op}: workspace size overflows")))?;
        Ok(())
    };
    let input_slots: Vec<usize> =
        (0..inputs.len()).map(|i| slots.iter().position(|s| *s == Some(i)).expect("every input has a slot")).collect();
    for (i, slot) in slots.iter().enumerate() {
        if let Some(t) = slot.and_then(|k| inputs[k].as_ref()) {
            stage(false, i, t.meta(), plan.input_needs.get(i).copied().unwrap_or_default())?;
        }
    }
    for (i, t) in outputs.iter().enumerate() {
        stage(true, i, t.meta(), plan.output_needs.get(i).copied().unwrap_or_default())?;
    }
    let workspace_size = if at == 0 { 0 } else { at + WS_ALIGN };
    let single_block =
        plan.steps.iter().all(|s| s.block_dim <= 1) && staging.iter().all(|s| copy_block_dim(&s.meta) <= 1);
    Ok(Planned {
        entry: entry.clone(),
        steps: plan.steps,
        slots,
        input_slots,
        staging,
        op_workspace: plan.workspace,
        workspace_size,
        single_block,
        dense_inputs,
        dense_outputs,
        profiled: OnceLock::new(),
    })
}

/// Plans kept per thread (cleared when full: the shapes of a model repeat, so a few dozen suffice).
const CACHED_PLANS: usize = 256;

thread_local! {
    static PLANNED: RefCell<FxHashMap<SignatureKey, Arc<Planned>>> = RefCell::new(FxHashMap::default());
}

/// Appends a tensor's dtype, shape, strides and offset (or its absence) to a signature.
pub fn meta_words(meta: Option<MetaRef<'_>>, key: &mut SignatureKey) {
    match meta {
        None => key.push(u64::MAX),
        Some(m) => {
            key.push(m.dtype as u64 | (m.shape.len() as u64) << 8);
            key.extend(m.shape.iter().map(|&d| d as u64));
            key.extend(m.strides.iter().map(|&d| d as u64));
            key.push(m.offset as u64);
        }
    }
}

/// A call's [`signature`]: inline up to a size that covers ops with a few rank-4 tensors, so
/// building and looking one up allocates nothing.
pub type SignatureKey = smallvec::SmallVec<[u64; 40]>;

/// Appends everything phase 1 depends on besides the outputs — the op, each input's
/// [`meta_words`] and the attribute names and values — to `key`. Frontends that cache their own
/// executors key them with this too.
pub fn signature<'m>(
    entry: &Arc<OpEntry>,
    inputs: impl Iterator<Item = Option<MetaRef<'m>>>,
    attrs: &[(&str, AttrValue)],
    key: &mut SignatureKey,
) {
    key.push(Arc::as_ptr(entry) as *const () as u64);
    for meta in inputs {
        meta_words(meta, key);
    }
    for (name, value) in attrs {
        key.push(name.len() as u64);
        key.extend(name.bytes().map(u64::from));
        match value {
            AttrValue::None => key.push(0),
            AttrValue::Int(v) => key.extend([1, *v as u64]),
            AttrValue::Float(v) => key.extend([2, v.to_bits()]),
            AttrValue::Bool(v) => key.extend([3, *v as u64]),
            AttrValue::Str(v) => {
                key.extend([4, v.len() as u64]);
                key.extend(v.bytes().map(u64::from));
            }
            AttrValue::Ints(v) => {
                key.extend([5, v.len() as u64]);
                key.extend(v.iter().map(|&i| i as u64));
            }
            AttrValue::DType(d) => key.extend([6, *d as u64]),
        }
    }
}

/// Rebinding keeps the plan: the new tensor must have the planned dtype, shape and strides.
/// (Checked on every re-launch, so nothing is formatted unless it fails.)
fn check_same_layout(op: &str, what: &str, i: usize, old: &TensorMeta, new: &TensorMeta) -> Result<()> {
    if old.dtype != new.dtype || old.shape() != new.shape() || old.layout.strides() != new.layout.strides() {
        return Err(Error::new(
            ErrorCode::ParamInvalid,
            format!("{op}: rebinding {what} {i}: expected a tensor like the planned one ({old}), got {new}"),
        ));
    }
    Ok(())
}

/// Whether `len` bytes at `ptr` hold a tensor laid out as `bound`. Every binding was checked
/// against its layout when made, so a length no shorter than the bound one fits without walking
/// the layout again (a frontend rebinding a same-shaped tensor passes the same length).
fn check_rebound(bound: &Bound, ptr: *const u8, len: usize) -> Result<()> {
    if len >= bound.len && (ptr as usize).is_multiple_of(bound.meta.dtype.size()) {
        return Ok(());
    }
    check_view(&bound.meta, ptr, len)
}

/// Per flattened tensor argument, its index among the caller's inputs (`None`: an in-place argument,
/// or an optional one left out).
type InputSlots = Vec<Option<usize>>;

/// Splits flattened inputs into per-argument groups as `OpEntry::bind` wants them, taking in-place
/// arguments from `written`. A `Tensor[]` argument takes all tensors not claimed by the other
/// arguments; trailing `Tensor?` arguments may be left out (absent). Also returns, per flattened
/// tensor slot, its index in `inputs` (`None`: in place, or left out).
fn group_inputs(
    entry: &OpEntry,
    inputs: &[Option<TensorRef<'_>>],
    written: &[&TensorMeta],
) -> Result<(Vec<Vec<TensorMeta>>, InputSlots)> {
    let args = entry.schema.inputs().filter(|a| a.ty.mutated.is_none()).count();
    let mut groups = Vec::with_capacity(entry.schema.inputs().count());
    let mut slots = Vec::with_capacity(inputs.len() + written.len());
    let mut it = inputs.iter().enumerate();
    let mut written = written.iter();
    for (arg, take) in entry.schema.tensor_args(inputs.len(), false) {
        if arg.ty.mutated.is_some() {
            groups.push(vec![(*written.next().expect("one written tensor per in-place argument")).clone()]);
            slots.push(None);
            continue;
        }
        let mut group = Vec::new();
        for _ in 0..take {
            let next = it.next();
            slots.extend(next.map(|(i, _)| Some(i)));
            match next.map(|(_, t)| t) {
                Some(Some(t)) => group.push(t.meta().clone()),
                Some(None) => {
                    if !arg.ty.optional {
                        return Err(Error::arg(ErrorCode::ParamNullptr, entry.name(), &arg.name, "a tensor", "none"));
                    }
                }
                // Trailing optional tensors may be left out, as their schema defaults say: an
                // op that gains one keeps its callers (the slot is unbound, as for `None`).
                None if arg.ty.optional && arg.ty.base != crate::schema::BaseType::TensorList => slots.push(None),
                None => {
                    return Err(Error::new(
                        ErrorCode::ParamInvalid,
                        format!("{}: expected {args} tensor inputs, got {}", entry.name(), inputs.len()),
                    ))
                }
            }
        }
        groups.push(group);
    }
    if it.next().is_some() {
        return Err(Error::new(
            ErrorCode::ParamInvalid,
            format!("{}: expected {args} tensor inputs, got {}", entry.name(), inputs.len()),
        ));
    }
    Ok((groups, slots))
}

/// The name of kernel input slot `k` of `slots` (schema order): the argument's, indexed for an
/// item of a list.
fn input_name(entry: &OpEntry, k: usize, slots: usize) -> String {
    let mut at = 0;
    for (arg, n) in entry.schema.tensor_args(slots, true) {
        if k < at + n {
            return if arg.ty.base == crate::schema::BaseType::TensorList {
                format!("{}[{}]", arg.name, k - at)
            } else {
                arg.name.clone()
            };
        }
        at += n;
    }
    format!("input {k}")
}

/// Enqueues `tasks` on `stream`; returns the first and last task numbers (they are consecutive
/// only if no other thread enqueues on the stream meanwhile, which waiting through the last
/// one tolerates).
fn enqueue(stream: &Stream, tasks: Launches) -> Option<(u64, u64)> {
    let mut range: Option<(u64, u64)> = None;
    for launch in tasks {
        let seq = stream.launch_shared(launch);
        range = Some((range.map_or(seq, |(first, _)| first), seq));
    }
    range
}

/// Blocks of the staging copy of a tensor like `meta`.
fn copy_block_dim(meta: &TensorMeta) -> u32 {
    block_dim_for(meta.numel(), meta.dtype.size())
}

/// Strided copy `src → dst` (same shape and dtype) as an SPMD task over element ranges; `step`
/// and `op` name it for the profiler.
fn copy_task(src: Bound, dst: Bound, step: &'static str, op: impl FnOnce() -> Arc<str>) -> Launch {
    let n = src.meta.numel();
    let size = src.meta.dtype.size();
    let runs = StridedRuns::<2>::new([&dst.meta.layout, &src.meta.layout]);
    let tiles = RowTiles::new(&dst.meta.layout, &src.meta.layout, size);
    let block_num = copy_block_dim(&src.meta);
    let label = profiler::label(
        op,
        step,
        LaunchKind::Staging,
        || profiler::describe_tensors(std::iter::once(&src.meta), std::iter::once(&dst.meta)),
        block_num,
    );
    let (src_ptr, dst_ptr) = (SendPtr(src.ptr), SendPtr(dst.ptr));
    let kernel = LaunchKernel::Closure(Arc::new(move |ctx: BlockCtx| {
        // SAFETY: both layouts were checked against their buffers; blocks copy disjoint rows or
        // element ranges of `dst`.
        unsafe {
            match &tiles {
                Some(tiles) => tiles.copy(dst_ptr.get(), src_ptr.get(), size, ctx.split(tiles.items())),
                None => runs.copy(dst_ptr.get(), src_ptr.get(), size, ctx.split(n)),
            }
        }
    }));
    Launch { block_num, kernel, label }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);

impl SendPtr {
    /// A method (not the field) so closures capture the whole `Send` wrapper.
    fn get(self) -> *mut u8 {
        self.0
    }
}
// SAFETY: used only inside launches whose executor guarantees the memory outlives them.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
