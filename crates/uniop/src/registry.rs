//! The op registry: the only thing frontends know about ops.
//!
//! Ops register once (built-ins at start, plugins when loaded); each entry keeps the op and its
//! parsed schema. Lookups hand out `Arc`s so an executor keeps its op alive even if a plugin
//! unregisters later.

use crate::autograd::BackwardWiring;
use crate::dtype::DType;
use crate::error::{Error, ErrorCode, Result};
use crate::layout::TensorMeta;
use crate::op::{runs_by_reference, Op, OpCx};
use crate::schema::{AttrValue, BaseType, OpSchema};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};

pub struct OpEntry {
    pub op: Box<dyn Op>,
    pub schema: OpSchema,
}

impl OpEntry {
    pub fn name(&self) -> &str {
        &self.schema.name
    }

    /// Binds input metas (one group per tensor argument: one meta for `Tensor`, zero or one for
    /// `Tensor?`, any number for `Tensor[]`) and attributes to this op — what `infer`, `plan`
    /// and `reference` look at. Calls that run the op's f64 reference (all floating tensors
    /// f64, see [`crate::op::runs_by_reference`]) pass its dtype checks here.
    pub fn bind(&self, inputs: Vec<Vec<TensorMeta>>, attrs: &[(&str, AttrValue)]) -> Result<OpCx<'_>> {
        let by_reference =
            runs_by_reference(self.op.as_ref(), &self.schema, &inputs.iter().flatten().collect::<Vec<_>>());
        let mut cx = OpCx::bind(&self.schema, inputs, attrs)?;
        cx.by_reference = by_reference;
        Ok(cx)
    }

    /// The op's outputs for `cx` (its `infer`). A call that runs the f64 reference returns every
    /// floating output in f64 — statistics an op keeps in f32 (`rstd`, `lse`, a loss) are f32
    /// because its kernels compute in f32; the reference computes in f64.
    pub fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let mut metas = self.op.infer(cx)?;
        if cx.by_reference {
            for m in metas.iter_mut().filter(|m| m.dtype.is_float()) {
                m.dtype = DType::F64;
            }
        }
        Ok(metas)
    }

    /// [`OpEntry::bind`] from flattened metas (a `Tensor[]` argument's items in a row; `None` for
    /// an absent `Tensor?`).
    pub fn bind_flat(&self, metas: Vec<Option<TensorMeta>>, attrs: &[(&str, AttrValue)]) -> Result<OpCx<'_>> {
        OpCx::group_flat(&self.schema, metas).and_then(|groups| self.bind(groups, attrs))
    }
}

static GLOBAL: OnceLock<Registry> = OnceLock::new();

#[derive(Default)]
pub struct Registry {
    ops: RwLock<BTreeMap<String, Arc<OpEntry>>>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    /// The process-wide registry every frontend reads.
    pub fn global() -> &'static Registry {
        GLOBAL.get_or_init(|| {
            crate::runtime::fork::install();
            Registry::new()
        })
    }

    /// The global registry's lock, held by [`fork`](crate::runtime::fork)'s handler while the
    /// process forks: no writer may be halfway through an insertion then.
    pub(crate) fn hold_for_fork() -> Option<Box<dyn std::any::Any>> {
        let guard = GLOBAL.get()?.ops.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        Some(Box::new(guard))
    }

    /// Parses the op's schema and adds it. Errors on a bad schema or a duplicate name.
    pub fn register(&self, op: Box<dyn Op>) -> Result<()> {
        let schema = OpSchema::parse(op.schema())?;
        check_leading_batch_args(op.as_ref(), &schema)?;
        check_core_dims(op.as_ref(), &schema)?;
        let mut ops = self.ops.write().unwrap();
        if ops.contains_key(&schema.name) {
            return Err(Error::invalid(format!("op '{}' is already registered", schema.name)));
        }
        ops.insert(schema.name.clone(), Arc::new(OpEntry { op, schema }));
        Ok(())
    }

    pub fn get(&self, name: &str) -> Result<Arc<OpEntry>> {
        let ops = self.ops.read().unwrap();
        ops.get(name).cloned().ok_or_else(|| {
            let near: Vec<&str> =
                ops.keys().map(String::as_str).filter(|k| k.contains(name) || name.contains(*k)).collect();
            let hint = if near.is_empty() {
                format!("registered: {}", ops.keys().map(String::as_str).collect::<Vec<_>>().join(", "))
            } else {
                format!("did you mean: {}", near.join(", "))
            };
            Error::new(ErrorCode::ParamInvalid, format!("unknown op '{name}' ({hint})"))
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.ops.read().unwrap().contains_key(name)
    }

    /// All entries, sorted by name.
    pub fn list(&self) -> Vec<Arc<OpEntry>> {
        self.ops.read().unwrap().values().cloned().collect()
    }

    /// The op computing `forward`'s input gradients, with how to call it; `None` for an op that
    /// is not differentiable. Errors when the backward it names is not registered or its schema
    /// breaks the naming convention of [`Op::backward`].
    pub fn backward_of(&self, forward: &OpEntry) -> Result<Option<(Arc<OpEntry>, BackwardWiring)>> {
        let Some(name) = forward.op.backward() else { return Ok(None) };
        let backward = self
            .get(name)
            .map_err(|e| Error::new(e.code(), format!("{}: its backward op: {}", forward.name(), e.message())))?;
        let wiring = BackwardWiring::new(&forward.schema, &backward.schema)?;
        Ok(Some((backward, wiring)))
    }
}

/// What frontends assume of [`Op::leading_batch_args`]: tensor arguments of the schema (a list's
/// items each batched, as cat's), not written in place, and no such set on an elementwise op,
/// which batches its own way.
fn check_leading_batch_args(op: &dyn Op, schema: &OpSchema) -> Result<()> {
    let names = op.leading_batch_args();
    if !names.is_empty() && op.elementwise() {
        return Err(Error::invalid(format!(
            "op '{}': leading_batch_args {names:?} on an elementwise op (expected none: elementwise ops batch by \
             broadcasting)",
            schema.name
        )));
    }
    for name in names {
        check_batched_tensor(schema, "leading_batch_args", name, true)?;
    }
    // `batch_dims` is the per-sample form of a reduction over those rows (see
    // `Op::leading_batch_args`): frontends add one per batch, so it must be an int defaulting to
    // "all rows", on an op whose rows they batch; and an op returning such a sum has one.
    let batch_dims = schema.args.iter().find(|a| a.name == "batch_dims");
    let shared_sums: Vec<_> = (0..schema.returns.len())
        .map(|i| schema.return_name(i))
        .filter(|r| {
            let tensor = |arg| schema.args.iter().any(|a| a.name == arg && a.ty.base == BaseType::Tensor);
            r.strip_prefix('d').is_some_and(|arg| !names.contains(&arg) && tensor(arg))
        })
        .collect();
    if !names.is_empty() && batch_dims.is_none() && !shared_sums.is_empty() {
        return Err(Error::invalid(format!(
            "op '{}': returns {} (the gradient of an argument outside leading_batch_args {names:?}, a sum over \
             every row) without `int batch_dims=0` (expected one, to keep those sums per sample)",
            schema.name,
            shared_sums.join(", ")
        )));
    }
    if let Some(arg) = batch_dims {
        let is_count = arg.ty.base == BaseType::Int && !arg.ty.optional;
        if !is_count || arg.default != Some(AttrValue::Int(0)) || names.is_empty() {
            return Err(Error::invalid(format!(
                "op '{}': argument 'batch_dims' (expected `int batch_dims=0` on an op declaring leading_batch_args, \
                 given `{} batch_dims{}`{})",
                schema.name,
                arg.ty,
                arg.default.as_ref().map_or(String::new(), |d| format!("={d}")),
                if names.is_empty() { " without leading_batch_args" } else { "" }
            )));
        }
    }
    Ok(())
}

/// What frontends assume of [`Op::core_dims`]: plain tensor arguments, each named once, on an op
/// that batches no other way.
fn check_core_dims(op: &dyn Op, schema: &OpSchema) -> Result<()> {
    let cores = op.core_dims();
    if !cores.is_empty() && (op.elementwise() || !op.leading_batch_args().is_empty()) {
        return Err(Error::invalid(format!(
            "op '{}': core_dims {cores:?} on an op that is elementwise or declares leading_batch_args (expected \
             one way to batch)",
            schema.name
        )));
    }
    for (i, (name, _)) in cores.iter().enumerate() {
        check_batched_tensor(schema, "core_dims", name, false)?;
        if cores[..i].iter().any(|(earlier, _)| earlier == name) {
            return Err(Error::invalid(format!(
                "op '{}': core_dims names '{name}' twice (expected each argument once)",
                schema.name
            )));
        }
    }
    Ok(())
}

/// An argument a batching declaration (`what`) names must be a Tensor (or, with `lists`, a
/// Tensor[]) not written in place.
fn check_batched_tensor(schema: &OpSchema, what: &str, name: &str, lists: bool) -> Result<()> {
    let arg = schema.args.iter().find(|a| a.name == name);
    let batchable = |base| base == BaseType::Tensor || (lists && base == BaseType::TensorList);
    if !arg.is_some_and(|a| batchable(a.ty.base) && a.ty.mutated.is_none()) {
        let given = arg.map_or("no such argument".to_string(), |a| format!("{}", a.ty));
        let expected = if lists { "a Tensor or Tensor[]" } else { "a Tensor" };
        return Err(Error::invalid(format!(
            "op '{}': {what} names '{name}' (expected {expected} argument not written in place, given {given})",
            schema.name
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::Source;
    use crate::op::{Example, Plan, RefTensor};

    /// An op that only declares a schema and a backward: what `backward_of` reads. Nothing runs it.
    struct Declared(&'static str, Option<&'static str>);

    impl Op for Declared {
        fn schema(&self) -> &'static str {
            self.0
        }
        fn doc(&self) -> &'static str {
            "an op that is only declared (test)"
        }
        fn dtypes(&self) -> &'static [DType] {
            &[DType::F32]
        }
        fn backward(&self) -> Option<&'static str> {
            self.1
        }
        fn infer(&self, _: &OpCx) -> Result<Vec<TensorMeta>> {
            Err(Error::invalid("declared only"))
        }
        fn plan(&self, _: &OpCx) -> Result<Plan> {
            Err(Error::invalid("declared only"))
        }
        fn reference(&self, _: &OpCx, _: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
            Err(Error::invalid("declared only"))
        }
        fn example(&self, _: Option<&[usize]>, _: DType) -> Result<Example> {
            Err(Error::invalid("declared only"))
        }
    }

    #[test]
    fn backward_of_wires_a_registered_backward_and_names_what_is_wrong() {
        let registry = Registry::new();
        let declare = |schema, backward| registry.register(Box::new(Declared(schema, backward))).unwrap();
        declare("plain(Tensor x) -> Tensor y", None);
        declare("orphan(Tensor x) -> Tensor y", Some("orphan_backward"));
        declare("miswired(Tensor x) -> Tensor y", Some("miswired_backward"));
        declare("miswired_backward(Tensor dy, Tensor z) -> Tensor dx", None);
        declare("scale(Tensor x, float s) -> Tensor y", Some("scale_backward"));
        declare("scale_backward(Tensor dy, float s) -> Tensor dx", None);
        let backward_of = |name| registry.backward_of(&registry.get(name).unwrap());

        assert!(backward_of("plain").unwrap().is_none());
        let (backward, wiring) = backward_of("scale").unwrap().unwrap();
        assert_eq!((backward.name(), wiring.sources), ("scale_backward", vec![Source::Grad(0), Source::Arg(1)]));
        let Err(orphan) = backward_of("orphan") else { panic!("orphan's backward is not registered") };
        assert!(orphan.message().starts_with("orphan: its backward op: unknown op 'orphan_backward'"), "{orphan}");
        let Err(miswired) = backward_of("miswired") else { panic!("miswired_backward takes a 'z'") };
        assert_eq!(miswired.code(), ErrorCode::ParamInvalid);
        assert!(miswired.message().contains("miswired_backward of miswired: argument 'z'"), "{miswired}");
    }
}
