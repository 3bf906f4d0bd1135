//! The op model: what an op author writes once.
//!
//! An op is a value implementing [`Op`]: its schema line, `infer` (metas in → metas out, or an error
//! naming the argument), `plan` (phase 1: pick the kernel, size the workspace, say which layouts the
//! kernel accepts) and an f64 `reference`. Frontends never see more than this trait and the
//! registry, which is what lets one definition serve every runtime.

use crate::dtype::DType;
use crate::error::{Error, ErrorCode, Result};
use crate::layout::{Layout, ShapeDisplay, TensorMeta};
use crate::registry::OpEntry;
use crate::runtime::BlockCtx;
use crate::schema::{AttrValue, BaseType, OpSchema};
use crate::tensor::TensorRef;
use std::ops::Range;
use std::sync::Arc;

pub trait Op: Send + Sync + 'static {
    /// One line of PyTorch schema language; the registry parses it once.
    fn schema(&self) -> &'static str;
    /// What the op computes, its semantics choices and references (shown by `uniop describe`).
    fn doc(&self) -> &'static str;
    /// Dtypes the kernels accept (for the main tensor input).
    fn dtypes(&self) -> &'static [DType];
    /// Name of the op computing this op's input gradients, if it is differentiable. Frontends
    /// wire it by argument names, so its schema follows one convention: an argument `d<name>` is
    /// the gradient of this op's return `<name>`; any other argument is this op's argument or
    /// return of the same name; a return `d<name>` is the gradient of tensor argument `<name>`
    /// (arguments without one get none; a `Tensor[]` argument's gradient is a `Tensor[]` return,
    /// one tensor per item: cat's); a `bool needs_d<name>` argument says whether the caller
    /// wants that gradient (frontends pass whether `<name>` requires one), for a gradient that
    /// costs extra work: when false the backward returns it empty (attention's float `mask`).
    /// Returns whose gradient the backward does not take (`rstd`, `lse`) are not differentiable.
    /// [`Registry::backward_of`](crate::Registry::backward_of) resolves these names (a
    /// [`BackwardWiring`](crate::autograd::BackwardWiring)) and refuses a schema that breaks them.
    fn backward(&self) -> Option<&'static str> {
        None
    }
    /// How mixed-precision autocast (torch's) treats the op; most ops run in their inputs' dtype.
    fn autocast(&self) -> Autocast {
        Autocast::Keep
    }
    /// Whether the op is elementwise over broadcast operands: each output element depends only on
    /// the operands' elements at its own (broadcast) index, no attribute names a dim, and each
    /// return has the operands' broadcast shape, or, named `d<arg>`, the shape of tensor argument
    /// `<arg>` (a gradient summed back to it). A batch of such calls is then one call on operands
    /// given a leading batch dim, which is how frontends batch it (torch.func.vmap) instead of
    /// calling it once per sample.
    fn elementwise(&self) -> bool {
        false
    }
    /// The tensor arguments along whose leading dims the op works row by row, so that a batch of
    /// calls is one call on those arguments given a new leading batch dim (a list argument's
    /// items each; the other tensor arguments shared, unbatched): each return (a list's items)
    /// then gains the leading dim, holding the per-sample returns; an `int dim` argument names an
    /// axis of those arguments, so a non-negative one counts one more. Frontends batch such calls
    /// this way (torch.func.vmap) and fall back to one call per sample when another tensor
    /// argument carries the batch. An op that sums over those rows (a parameter's gradient)
    /// batches only with an `int batch_dims=0` argument: the leading dims of the rows kept apart
    /// in the sums (one per sample), which a batch raises by one: a return `d<arg>` of a tensor
    /// argument outside the set (rms_norm_backward's `dweight`, attention_backward's `dsinks`) is
    /// such a sum, and the registry refuses an op returning one without `batch_dims`. Empty where
    /// no such set exists: elementwise ops (see [`Op::elementwise`]), a reduction with no
    /// per-sample form (a mean loss), seeded sampling, ops on fixed-rank layouts, ops whose
    /// `int dim` is not an axis (rope_cos_sin's rotary dim: it declares [`Op::core_dims`]).
    fn leading_batch_args(&self) -> &'static [&'static str] {
        &[]
    }
    /// For an op mapping blocks over broadcast batch dims, as NumPy's generalized ufuncs (matmul:
    /// `[.., M, K] · [.., K, N]`; rope: rows of x against its tables' rows; rope_cos_sin: each
    /// position a row of the tables, core rank 0): the tensor arguments it maps, each with its
    /// core's rank (the last dims, one block). The dims in front of the cores broadcast together as
    /// an elementwise op's operands do (an op may refuse some of those broadcasts, as rope refuses
    /// tables of more dims than x: a frontend infers one sample's call before batching), and each
    /// return has those broadcast dims then its own core, or, named `d<arg>`, the shape of tensor
    /// argument `<arg>` (a gradient summed back over the dims it was broadcast to). A batch of
    /// calls is then one call on these arguments given a leading batch dim, their batch dims padded
    /// with 1s to a common count (an unbatched one expanded, so a gradient summed back to it stays
    /// one per sample): how frontends batch it (torch.func.vmap); they fall back to one call per
    /// sample when another tensor argument carries the batch. Empty for elementwise ops (every
    /// tensor argument a core of rank 0 and no return with a core of its own:
    /// [`Op::elementwise`]) and ops with their own batching ([`Op::leading_batch_args`]).
    fn core_dims(&self) -> &'static [(&'static str, usize)] {
        &[]
    }
    /// Metas (contiguous) of the returns from input metas and attributes. In-place arguments
    /// are not returns: validate them here, they keep the caller's layout.
    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>>;
    /// Phase 1: kernel choice, workspace and layout needs. `cx` has passed `infer`.
    fn plan(&self, cx: &OpCx) -> Result<Plan>;
    /// The obviously-correct f64 computation used by tests and `uniop run`. Inputs arrive
    /// contiguous (logical order) as [`RefTensor`]s, one slot per tensor (absent optional ones,
    /// left out by the caller included, are `None`). Returns
    /// the final values of every tensor the op writes: in-place arguments, then returns.
    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>>;
    /// How much larger than one rounding of the output the kernel's error may legitimately be,
    /// for reference checks: long reductions (a K-term dot product) grow it like √K. Scales
    /// the absolute tolerance.
    fn error_scale(&self, _cx: &OpCx) -> f64 {
        1.0
    }
    /// Representative inputs: from one user-given shape (the op decides what it means — usually
    /// the main input's shape) or the op's default LLM-sized shape.
    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example>;
    /// The shape `example` takes that gives back `example` (what benchmark reports name, and
    /// peers rebuild their inputs from): the first input's unless the op reads its shape
    /// argument as another input's.
    fn example_shape(&self, example: &Example) -> Vec<usize> {
        example.input_shape(0)
    }
    /// Bytes one launch reads and writes, for bandwidth figures, when that is not every element
    /// of every tensor once (an op that updates a slice of an in-place tensor).
    fn bytes_moved(&self, _cx: &OpCx) -> Option<usize> {
        None
    }
}

/// What an op asks of an autocast region, in torch's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Autocast {
    /// Run in the inputs' dtypes (elementwise ops, norms that keep the input dtype).
    Keep,
    /// Cast floating inputs to the region's lower precision (GEMM-bound ops: matmul, attention).
    LowerPrecision,
    /// Cast floating inputs to f32 (reductions that lose accuracy in half precision).
    Float32,
}

impl Autocast {
    /// The policy's name for frontends, `None` for [`Autocast::Keep`].
    pub fn name(self) -> Option<&'static str> {
        match self {
            Autocast::Keep => None,
            Autocast::LowerPrecision => Some("lower"),
            Autocast::Float32 => Some("float32"),
        }
    }
}

/// A contiguous f64 tensor for references.
#[derive(Clone, Debug, PartialEq)]
pub struct RefTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

impl RefTensor {
    pub fn new(shape: &[usize], data: Vec<f64>) -> RefTensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        RefTensor { shape: shape.to_vec(), data }
    }

    pub fn from_view(view: &TensorRef<'_>) -> RefTensor {
        RefTensor { shape: view.shape().to_vec(), data: view.to_f64_vec() }
    }

    /// Value at logical index `i` of a tensor broadcast to `shape` (trailing-aligned).
    pub fn broadcast_get(&self, shape: &[usize], i: usize) -> f64 {
        self.data[broadcast_offset(&self.shape, shape, i)]
    }

    /// This tensor summed over the dims along which a tensor of `shape` broadcasts to it: the
    /// gradient of an operand that broadcasting stretched (torch's `sum_to_size`).
    pub fn sum_to(&self, shape: &[usize]) -> RefTensor {
        let mut data = vec![0.0; shape.iter().product()];
        for (i, &v) in self.data.iter().enumerate() {
            data[broadcast_offset(shape, &self.shape, i)] += v;
        }
        RefTensor::new(shape, data)
    }
}

/// The offset, in a contiguous tensor of shape `own`, of logical index `i` of it broadcast to `shape`.
fn broadcast_offset(own: &[usize], shape: &[usize], mut i: usize) -> usize {
    let lead = shape.len() - own.len();
    let mut off = 0;
    let mut stride = 1;
    for d in (0..shape.len()).rev() {
        let idx = i % shape[d];
        i /= shape[d];
        if d >= lead {
            let size = own[d - lead];
            if size != 1 {
                off += idx * stride;
            }
            stride *= size;
        }
    }
    off
}

/// Whether a call of `op` with these tensors (inputs, then in-place arguments) runs the op's f64
/// reference as its kernel: the op has no f64 kernels of its own, writes nothing in place, and
/// every floating tensor of the call is f64 (there is at least one).
///
/// Why: DESIGN gives f64 one job — references and gradient checks. `torch.autograd.gradcheck`
/// needs f64 forward and backward calls, and every op already has an obviously-correct f64
/// reference; running it as the kernel gives every op (and every plugin op) an exact f64 path
/// with no f64 kernels to write or keep in step. It runs single-threaded: this is for checking,
/// not for speed.
pub(crate) fn runs_by_reference(op: &dyn Op, schema: &OpSchema, tensors: &[&TensorMeta]) -> bool {
    let floats = || tensors.iter().filter(|m| m.dtype.is_float());
    !op.dtypes().contains(&DType::F64)
        && schema.mutated().next().is_none()
        && floats().next().is_some()
        && floats().all(|m| m.dtype == DType::F64)
}

/// The plan of a call that [`runs_by_reference`]: one single-block step that reads the inputs
/// (made contiguous by staging), runs `reference` and writes its values into the `outputs`.
pub(crate) fn reference_plan(entry: &Arc<OpEntry>, cx: &OpCx, outputs: usize) -> Plan {
    let entry = entry.clone();
    let (inputs, groups, attrs) = (cx.inputs.clone(), cx.groups.clone(), cx.attrs.clone());
    let input_needs = vec![LayoutNeed::Contiguous; inputs.len()];
    let step = Step::new("reference_f64", 1, move |args: &KernelArgs, _ctx: BlockCtx| {
        let cx = OpCx {
            schema: &entry.schema,
            inputs: inputs.clone(),
            groups: groups.clone(),
            attrs: attrs.clone(),
            by_reference: true,
        };
        let refs: Vec<Option<RefTensor>> =
            (0..args.inputs.len()).map(|i| args.optional_input(i).map(|t| RefTensor::from_view(&t))).collect();
        // A reference rejects what `infer` let through only when the values are bad (an index
        // out of range): a kernel failure, reported like any kernel's.
        let values = entry.op.reference(&cx, &refs).unwrap_or_else(|e| panic!("{e}"));
        // An empty output has nothing to write (and its layout's offset may lie past its storage).
        for (i, v) in values.iter().enumerate().filter(|(_, v)| !v.data.is_empty()) {
            let out = args.output(i);
            crate::dispatch_element!(out.meta().dtype, |T| {
                // SAFETY: one block writes the whole (contiguous, staged if need be) output.
                let dst = unsafe { out.slice_mut::<T>(out.layout().offset(), v.data.len()) };
                for (d, &x) in dst.iter_mut().zip(&v.data) {
                    *d = <T as crate::Element>::from_f64(x);
                }
            })
        }
    });
    Plan { steps: vec![step], workspace: 0, input_needs, output_needs: vec![LayoutNeed::Contiguous; outputs] }
}

/// Inputs and attributes for `uniop run`, tests and benchmarks.
#[derive(Clone, Debug, Default)]
pub struct Example {
    pub inputs: Vec<Option<TensorMeta>>,
    pub attrs: Vec<(String, AttrValue)>,
    /// Per input, the half-open range random values are drawn from when the op needs one (e.g.
    /// valid indices); `None` or missing: [-1, 1) for floats, [-8, 8] for integers.
    pub ranges: Vec<Option<(f64, f64)>>,
}

impl Example {
    /// Input `i`'s shape (empty when it is absent).
    pub fn input_shape(&self, i: usize) -> Vec<usize> {
        self.inputs.get(i).cloned().flatten().map(|m| m.shape().to_vec()).unwrap_or_default()
    }
}

/// What the op gets to look at: its schema, input metas and resolved attributes.
pub struct OpCx<'s> {
    pub schema: &'s OpSchema,
    /// One entry per tensor (a `Tensor[]` argument contributes several).
    pub(crate) inputs: Vec<Option<TensorMeta>>,
    /// For each tensor argument of the schema, its range in `inputs`.
    groups: Vec<Range<usize>>,
    /// One value per non-tensor argument, defaults filled in.
    attrs: Vec<AttrValue>,
    /// The call runs the op's f64 reference (see [`reference_plan`]): dtype checks accept f64
    /// wherever they accept a floating dtype.
    pub(crate) by_reference: bool,
}

impl<'s> OpCx<'s> {
    /// Binds input metas and attributes (by name; defaults applied; types checked) to `schema`.
    /// `inputs` holds one group per tensor argument: one meta for `Tensor`, zero or one for
    /// `Tensor?`, any number for `Tensor[]`.
    pub(crate) fn bind(
        schema: &'s OpSchema,
        mut inputs: Vec<Vec<TensorMeta>>,
        attrs: &[(&str, AttrValue)],
    ) -> Result<OpCx<'s>> {
        let op = schema.name.as_str();
        let tensor_args = schema.inputs().count();
        // Trailing optional tensors may be left out (absent), as the executor allows.
        let optional_tail =
            schema.inputs().skip(inputs.len()).all(|a| a.ty.optional && a.ty.base != BaseType::TensorList);
        if inputs.len() < tensor_args && optional_tail {
            inputs.resize_with(tensor_args, Vec::new);
        }
        if inputs.len() != tensor_args {
            let args: Vec<_> = schema.inputs().collect();
            return Err(Error::new(
                ErrorCode::ParamInvalid,
                format!("{op}: expected {tensor_args} tensor inputs ({}), got {}", names(&args), inputs.len()),
            ));
        }
        let mut flat = Vec::with_capacity(inputs.iter().map(|g| g.len().max(1)).sum());
        let mut groups = Vec::with_capacity(tensor_args);
        for (arg, group) in schema.inputs().zip(inputs) {
            let start = flat.len();
            match (arg.ty.base, group.len()) {
                (BaseType::TensorList, _) => flat.extend(group.into_iter().map(Some)),
                (_, 1) => flat.extend(group.into_iter().map(Some)),
                (_, 0) if arg.ty.optional => flat.push(None),
                (_, 0) => return Err(Error::arg(ErrorCode::ParamNullptr, op, &arg.name, "a tensor", "none")),
                (_, n) => {
                    return Err(Error::arg(
                        ErrorCode::ParamInvalid,
                        op,
                        &arg.name,
                        "one tensor",
                        format!("{n} tensors"),
                    ))
                }
            }
            groups.push(start..flat.len());
        }
        for (name, _) in attrs {
            if !schema.attrs().any(|a| a.name == *name) {
                let known: Vec<_> = schema.attrs().map(|a| a.name.as_str()).collect();
                return Err(Error::new(
                    ErrorCode::ParamInvalid,
                    format!(
                        "{op}: unknown attribute '{name}' (attributes: {})",
                        if known.is_empty() { "none".to_string() } else { known.join(", ") }
                    ),
                ));
            }
        }
        let mut values = Vec::with_capacity(schema.args.len() - tensor_args);
        for arg in schema.attrs() {
            let given = attrs.iter().rev().find(|(n, _)| *n == arg.name).map(|(_, v)| v.clone());
            let value = match (given, &arg.default) {
                (Some(v), _) => v,
                (None, Some(d)) => d.clone(),
                (None, None) => {
                    return Err(Error::arg(
                        ErrorCode::ParamNullptr,
                        op,
                        &arg.name,
                        format!("a value of type {}", arg.ty),
                        "none",
                    ))
                }
            };
            // Callers outside a schema (CLI, C) spell dtypes as strings.
            let value = match (value, arg.ty.base) {
                (AttrValue::Str(s), BaseType::ScalarType) => {
                    AttrValue::DType(DType::parse(s.strip_prefix("torch.").unwrap_or(&s)).map_err(|_| {
                        Error::arg(ErrorCode::DType, op, &arg.name, "a dtype name such as float32 or bfloat16", &s)
                    })?)
                }
                (v, _) => v,
            };
            if !value.fits(arg.ty) {
                return Err(Error::arg(
                    ErrorCode::ParamInvalid,
                    op,
                    &arg.name,
                    format!("a value of type {}", arg.ty),
                    &value,
                ));
            }
            values.push(match (value, arg.ty.base) {
                (AttrValue::Int(v), BaseType::Float) => AttrValue::Float(v as f64),
                (v, _) => v,
            });
        }
        Ok(OpCx { schema, inputs: flat, groups, attrs: values, by_reference: false })
    }

    /// [`OpCx::bind`] for tensor metas given flat in schema order (in-place arguments included):
    /// one per `Tensor`, `None` for an absent `Tensor?`; a `Tensor[]` takes the tensors the other
    /// arguments leave.
    /// Splits flattened metas into per-argument groups (see [`OpEntry::bind_flat`]).
    pub(crate) fn group_flat(schema: &OpSchema, metas: Vec<Option<TensorMeta>>) -> Result<Vec<Vec<TensorMeta>>> {
        let given = metas.len();
        let mut metas = metas.into_iter();
        let groups =
            schema.tensor_args(given, true).map(|(_, take)| metas.by_ref().take(take).flatten().collect()).collect();
        if metas.next().is_some() {
            let want = schema.inputs().count();
            return Err(Error::new(
                ErrorCode::ParamInvalid,
                format!("{}: expected {want} tensor inputs, got {given}", schema.name),
            ));
        }
        Ok(groups)
    }

    pub fn op(&self) -> &str {
        &self.schema.name
    }

    fn tensor_arg(&self, name: &str) -> usize {
        self.schema
            .inputs()
            .position(|a| a.name == name)
            .unwrap_or_else(|| panic!("{}: no tensor argument '{name}' in the schema", self.op()))
    }

    /// Meta of a required tensor argument. Panics if `name` is not in the schema (an op bug).
    pub fn input(&self, name: &str) -> &TensorMeta {
        let g = &self.groups[self.tensor_arg(name)];
        self.inputs[g.start].as_ref().expect("required inputs are bound")
    }

    pub fn optional_input(&self, name: &str) -> Option<&TensorMeta> {
        let g = &self.groups[self.tensor_arg(name)];
        self.inputs[g.start].as_ref()
    }

    pub fn input_list(&self, name: &str) -> Vec<&TensorMeta> {
        let g = self.groups[self.tensor_arg(name)].clone();
        self.inputs[g].iter().flatten().collect()
    }

    /// Index of a tensor argument's first tensor in the flattened input order (as the kernel
    /// sees it through [`KernelArgs::input`]).
    pub fn input_index(&self, name: &str) -> usize {
        self.groups[self.tensor_arg(name)].start
    }

    pub fn flat_inputs(&self) -> &[Option<TensorMeta>] {
        &self.inputs
    }

    pub fn attr(&self, name: &str) -> &AttrValue {
        let i = self
            .schema
            .attrs()
            .position(|a| a.name == name)
            .unwrap_or_else(|| panic!("{}: no attribute '{name}' in the schema", self.op()));
        &self.attrs[i]
    }

    pub fn attr_values(&self) -> &[AttrValue] {
        &self.attrs
    }

    /// A `float` or `Scalar` attribute as f64 (a bool `Scalar` is 0 or 1).
    pub fn float(&self, name: &str) -> f64 {
        match self.attr(name) {
            AttrValue::Float(v) => *v,
            AttrValue::Int(v) => *v as f64,
            AttrValue::Bool(v) => f64::from(u8::from(*v)),
            other => panic!("{}: attribute '{name}' is {other}, not a number", self.op()),
        }
    }

    /// A `Scalar` attribute as an exact integer: ints and bools as they are, floats only when
    /// integral (and in i64 range); `None` otherwise.
    pub fn scalar_int(&self, name: &str) -> Option<i64> {
        match self.attr(name) {
            AttrValue::Int(v) => Some(*v),
            AttrValue::Bool(v) => Some(i64::from(*v)),
            AttrValue::Float(v) if v.fract() == 0.0 && v.abs() < 9.2e18 => Some(*v as i64),
            _ => None,
        }
    }

    /// Whether the caller asks for the gradient of tensor argument `operand`: the schema's `bool
    /// needs_d<operand>` argument (see [`Op::backward`]), true where the schema has none.
    pub fn needs_grad(&self, operand: &str) -> bool {
        // Matched by parts, not a formatted name: infer and plan ask on every call.
        self.schema
            .attrs()
            .position(|a| a.name.strip_prefix("needs_d") == Some(operand))
            .is_none_or(|i| !matches!(self.attrs[i], AttrValue::Bool(false)))
    }

    /// The shape of `operand`'s gradient: `shape` where the caller asks for it
    /// ([`needs_grad`](Self::needs_grad)), else `[0]` — empty, as a backward returns a gradient
    /// nobody asked for.
    pub fn grad_shape(&self, operand: &str, shape: &[usize]) -> Vec<usize> {
        if self.needs_grad(operand) {
            shape.to_vec()
        } else {
            vec![0]
        }
    }

    pub fn int(&self, name: &str) -> i64 {
        match self.attr(name) {
            AttrValue::Int(v) => *v,
            other => panic!("{}: attribute '{name}' is {other}, not an int", self.op()),
        }
    }

    // ---- helpers for infer: each returns the error message users will read ----

    pub fn err(
        &self,
        code: ErrorCode,
        arg: &str,
        expected: impl std::fmt::Display,
        given: impl std::fmt::Display,
    ) -> Error {
        Error::arg(code, self.op(), arg, expected, given)
    }

    /// The dtype of the statistics an op returns in f32 whatever its inputs (`rstd`, `lse`, a
    /// loss), for checking them when a backward op takes them back: f32, or f64 when the call
    /// runs the f64 reference (whose outputs are all f64).
    pub fn statistics_dtype(&self) -> DType {
        if self.by_reference {
            DType::F64
        } else {
            DType::F32
        }
    }

    /// Checks `arg`'s dtype is one of `allowed` (or f64 in place of a floating dtype, when the
    /// call runs the op's f64 reference).
    pub fn expect_dtype_in(&self, arg: &str, allowed: &[DType]) -> Result<DType> {
        let d = self.input(arg).dtype;
        if allowed.contains(&d) || (self.by_reference && d == DType::F64 && allowed.iter().any(|a| a.is_float())) {
            return Ok(d);
        }
        let names: Vec<_> = allowed.iter().map(|d| d.name()).collect();
        Err(self.err(ErrorCode::DType, arg, format!("dtype in {{{}}}", names.join(", ")), d))
    }

    /// Checks `arg` has dtype `want` (because another argument has it).
    pub fn expect_same_dtype(&self, arg: &str, want: DType, because: &str) -> Result<()> {
        let d = self.input(arg).dtype;
        if d != want {
            return Err(self.err(ErrorCode::DType, arg, format!("dtype {want} (same as '{because}')"), d));
        }
        Ok(())
    }

    pub fn expect_shape(&self, arg: &str, want: &[usize]) -> Result<()> {
        let got = self.input(arg).shape();
        if got != want {
            return Err(self.err(
                ErrorCode::Shape,
                arg,
                format!("shape {}", ShapeDisplay(want)),
                format!("shape {}", ShapeDisplay(got)),
            ));
        }
        Ok(())
    }

    pub fn expect_min_rank(&self, arg: &str, rank: usize) -> Result<()> {
        let got = self.input(arg).rank();
        if got < rank {
            return Err(self.err(
                ErrorCode::Shape,
                arg,
                format!("rank ≥ {rank}"),
                format!("rank {got} (shape {})", ShapeDisplay(self.input(arg).shape())),
            ));
        }
        Ok(())
    }
}

fn names(args: &[&crate::schema::Arg]) -> String {
    args.iter().map(|a| a.name.as_str()).collect::<Vec<_>>().join(", ")
}

/// The layout a kernel needs for a tensor; the executor stages a copy through the workspace when
/// the caller's tensor does not have it, so kernels stay simple and callers stay free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LayoutNeed {
    /// Any strides (the kernel walks them).
    #[default]
    Any,
    /// Last dim dense; leading dims any strides (row kernels).
    InnerContiguous,
    /// Fully row-major contiguous.
    Contiguous,
}

impl LayoutNeed {
    pub fn satisfied_by(self, layout: &Layout) -> bool {
        match self {
            LayoutNeed::Any => true,
            LayoutNeed::InnerContiguous => layout.is_inner_contiguous(),
            LayoutNeed::Contiguous => layout.is_contiguous(),
        }
    }
}

/// A kernel body as the executor runs it: one call per block.
pub type StepFn = Arc<dyn Fn(&KernelArgs, BlockCtx) + Send + Sync>;

/// One SPMD launch of a plan.
#[derive(Clone)]
pub struct Step {
    pub name: &'static str,
    pub block_dim: u32,
    pub kernel: StepFn,
}

impl Step {
    pub fn new(
        name: &'static str,
        block_dim: u32,
        kernel: impl Fn(&KernelArgs, BlockCtx) + Send + Sync + 'static,
    ) -> Step {
        Step { name, block_dim, kernel: Arc::new(kernel) }
    }
}

/// Phase-1 result of an op: the launches to run in order, the scratch they need and the layouts
/// they accept.
#[derive(Clone, Default)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// Scratch bytes the kernels use through [`KernelArgs::workspace`].
    pub workspace: usize,
    /// Per flattened input; missing entries mean [`LayoutNeed::Any`].
    pub input_needs: Vec<LayoutNeed>,
    /// Per output; missing entries mean [`LayoutNeed::Any`].
    pub output_needs: Vec<LayoutNeed>,
}

impl Plan {
    pub fn new(steps: Vec<Step>) -> Plan {
        Plan { steps, ..Plan::default() }
    }
    pub fn workspace(mut self, bytes: usize) -> Plan {
        self.workspace = bytes;
        self
    }
    pub fn inputs_need(mut self, needs: Vec<LayoutNeed>) -> Plan {
        self.input_needs = needs;
        self
    }
    pub fn outputs_need(mut self, needs: Vec<LayoutNeed>) -> Plan {
        self.output_needs = needs;
        self
    }
}

/// A tensor as bound for one launch: where its storage starts and how to read it.
#[derive(Clone, Debug)]
pub(crate) struct Bound {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) meta: TensorMeta,
}

/// What a kernel sees at launch time. Layouts here are the ones actually bound (after any staging
/// copy), so kernels read them from here rather than from plan time.
pub struct KernelArgs {
    pub(crate) inputs: Vec<Option<Bound>>,
    pub(crate) outputs: Vec<Bound>,
    pub(crate) workspace: *mut u8,
    pub(crate) workspace_len: usize,
}

// SAFETY: the executor guarantees the bound memory stays valid for the launch; kernels write
// outputs/workspace only through the `unsafe` accessors whose contract is disjointness.
unsafe impl Send for KernelArgs {}
unsafe impl Sync for KernelArgs {}

impl KernelArgs {
    /// Required input `i` (flattened order).
    pub fn input(&self, i: usize) -> TensorRef<'_> {
        self.optional_input(i).unwrap_or_else(|| {
            panic!("input {i} is not bound: an absent optional input (use optional_input) or an in-place argument (use output)")
        })
    }

    pub fn optional_input(&self, i: usize) -> Option<TensorRef<'_>> {
        // SAFETY: bound memory is valid and read-only for the duration of the launch, and every
        // binding was checked as a view when it was made (Executor::new, rebind_input, staging).
        self.inputs[i].as_ref().map(|b| unsafe { TensorRef::from_checked(b.ptr, b.len, b.meta.clone()) })
    }

    pub fn output(&self, i: usize) -> OutputView<'_> {
        let b = &self.outputs[i];
        OutputView { bound: b, _life: std::marker::PhantomData }
    }

    /// Elements `[start, start+len)` of the op's scratch (the plan's `workspace` bytes, 64-byte
    /// aligned), viewed as `T`. Panics when the range exceeds what the plan asked for.
    ///
    /// # Safety
    /// Blocks running concurrently must not access overlapping ranges when one of them writes.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn workspace<T: crate::Element>(&self, start: usize, len: usize) -> &mut [T] {
        assert!((start + len) * std::mem::size_of::<T>() <= self.workspace_len, "workspace range out of bounds");
        std::slice::from_raw_parts_mut((self.workspace as *mut T).add(start), len)
    }
}

/// An output as kernels see it: shared between blocks, written through disjoint pieces.
pub struct OutputView<'a> {
    bound: &'a Bound,
    _life: std::marker::PhantomData<&'a ()>,
}

impl<'a> OutputView<'a> {
    pub fn meta(&self) -> &TensorMeta {
        &self.bound.meta
    }
    pub fn layout(&self) -> &Layout {
        &self.bound.meta.layout
    }

    /// Storage elements `[start, start+len)` (offsets as the layout computes them).
    ///
    /// # Safety
    /// No other block may access these elements during the launch.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<T: crate::Element>(&self, start: usize, len: usize) -> &'a mut [T] {
        debug_assert_eq!(self.bound.meta.dtype, T::DTYPE);
        assert!((start + len) * std::mem::size_of::<T>() <= self.bound.len, "output slice out of bounds");
        std::slice::from_raw_parts_mut((self.bound.ptr as *mut T).add(start), len)
    }

    /// Raw pointer to storage element 0, for scattered writes.
    ///
    /// # Safety
    /// Writes must stay inside the layout's extent and not touch elements other blocks access.
    pub unsafe fn as_mut_ptr<T: crate::Element>(&self) -> *mut T {
        debug_assert_eq!(self.bound.meta.dtype, T::DTYPE);
        self.bound.ptr as *mut T
    }

    /// Raw pointer to the storage's first byte, for kernels that move elements of any dtype.
    ///
    /// # Safety
    /// As [`OutputView::as_mut_ptr`].
    pub unsafe fn as_mut_byte_ptr(&self) -> *mut u8 {
        self.bound.ptr
    }

    /// Row `r` of the `[rows, cols]` view; the last dim must be dense.
    ///
    /// # Safety
    /// No other block may access row `r` during the launch.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn row_mut<T: crate::Element>(&self, r: usize) -> &'a mut [T] {
        let layout = &self.bound.meta.layout;
        debug_assert!(layout.is_inner_contiguous());
        self.slice_mut(layout.row_offset(r), layout.rows_cols().1)
    }
}

/// A block count for `work` units of roughly `unit_bytes` each: enough blocks to balance the
/// pool (4 per thread) but none smaller than 32 KiB (`UNIOP_MIN_BLOCK_BYTES` where set), where
/// launch overhead would dominate.
pub fn block_dim_for(work: usize, unit_bytes: usize) -> u32 {
    let threads = crate::runtime::Pool::global().threads();
    let min_units = (min_block_bytes() / unit_bytes.max(1)).max(1);
    let by_size = work.div_ceil(min_units);
    by_size.clamp(1, threads * 4).min(work.max(1)) as u32
}

/// The least work [`block_dim_for`] gives a block: 32 KiB, or `UNIOP_MIN_BLOCK_BYTES` (read once,
/// as [`parse_bytes`](crate::runtime::parse_bytes) reads sizes) where set. At 1, every launch
/// splits into as many blocks as the pool balances, however small: the shape sweep runs so, to
/// reach the block boundaries (uneven splits, blocks of one row) that large tensors meet and its
/// small ones otherwise would not.
pub fn min_block_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| crate::runtime::env_bytes("UNIOP_MIN_BLOCK_BYTES").unwrap_or(32 << 10))
}
