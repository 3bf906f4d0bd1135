//! How a frontend's autograd calls an op's backward.
//!
//! An op names the op that computes its input gradients ([`Op::backward`](crate::Op::backward)),
//! and the backward's schema says by its names where each of its arguments comes from: the
//! gradient of a forward return, a forward argument or return, whether the caller wants a
//! gradient, or nothing (its default). [`BackwardWiring`] resolves that convention once per
//! forward/backward pair, so every caller that differentiates — `uniop.torch`'s autograd, the
//! test sweep that feeds a forward's results to its backward — reads it the same way, and a
//! backward whose schema breaks the convention gets one error that says which name is wrong.

use crate::error::{Error, ErrorCode, Result};
use crate::schema::OpSchema;

/// Where one argument of a backward op comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The gradient of forward return `i` (an argument named `d<return>`).
    Grad(usize),
    /// Forward argument `i` (the same name).
    Arg(usize),
    /// Forward return `i` (the same name): a result the backward reuses (`rstd`, `lse`, `out`).
    Out(usize),
    /// Whether the caller wants the gradient of forward argument `i` (a `bool needs_d<arg>`).
    NeedsGrad(usize),
    /// Nothing from the forward call: the backward argument's default.
    Default,
}

/// How a forward op's backward is called: one [`Source`] per backward argument, and the forward
/// argument each backward return is the gradient of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackwardWiring {
    /// Per backward argument, in schema order.
    pub sources: Vec<Source>,
    /// Per backward return: the index of the forward argument it is the gradient of.
    pub grad_of: Vec<usize>,
}

impl BackwardWiring {
    /// Resolves the names of `backward`'s schema against `forward`'s (the convention on
    /// [`Op::backward`](crate::Op::backward)).
    pub fn new(forward: &OpSchema, backward: &OpSchema) -> Result<BackwardWiring> {
        let refuse = |what: String| {
            Err(Error::new(
                ErrorCode::ParamInvalid,
                format!("backward op {} of {}: {what}", backward.name, forward.name),
            ))
        };
        if forward.returns_list() {
            return refuse(format!("{} returns a list of tensors, whose gradients cannot be wired", forward.name));
        }
        let arg = |name: &str| forward.args.iter().position(|a| a.name == name);
        let returns: Vec<String> = (0..forward.returns.len()).map(|i| forward.return_name(i)).collect();
        let ret = |name: &str| returns.iter().position(|r| r == name);
        let mut sources = Vec::with_capacity(backward.args.len());
        for a in &backward.args {
            let name = a.name.as_str();
            let source = if let Some(i) = name.strip_prefix('d').and_then(ret) {
                Source::Grad(i)
            } else if let Some(i) = name.strip_prefix("needs_d").and_then(arg) {
                Source::NeedsGrad(i)
            } else if let Some(i) = arg(name) {
                Source::Arg(i)
            } else if let Some(i) = ret(name) {
                Source::Out(i)
            } else if a.default.is_some() {
                Source::Default
            } else {
                return refuse(format!(
                    "argument '{name}' is neither a gradient (d<return>), nor an argument or return of {}, \
                     and has no default",
                    forward.name
                ));
            };
            sources.push(source);
        }
        let mut grad_of = Vec::with_capacity(backward.returns.len());
        for r in 0..backward.returns.len() {
            let name = backward.return_name(r);
            match name.strip_prefix('d').and_then(arg).filter(|&i| forward.args[i].ty.is_tensor()) {
                Some(i) => grad_of.push(i),
                None => return refuse(format!("return '{name}' is not d<tensor argument of {}>", forward.name)),
            }
        }
        Ok(BackwardWiring { sources, grad_of })
    }

    /// Whether forward return `i` is differentiable: the backward takes its gradient (a statistic
    /// such as `rstd` or `lse` it does not take is not).
    pub fn differentiable(&self, i: usize) -> bool {
        self.sources.contains(&Source::Grad(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wiring(forward: &str, backward: &str) -> Result<BackwardWiring> {
        BackwardWiring::new(&OpSchema::parse(forward).unwrap(), &OpSchema::parse(backward).unwrap())
    }

    #[test]
    fn names_pick_each_source() {
        let w = wiring(
            "norm(Tensor x, Tensor? weight=None, float eps=1e-06) -> (Tensor y, Tensor rstd)",
            "norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, bool needs_dweight=True, \
             int batch_dims=0) -> (Tensor dx, Tensor dweight)",
        )
        .unwrap();
        use Source::*;
        assert_eq!(w.sources, [Grad(0), Arg(0), Arg(1), Out(1), NeedsGrad(1), Default]);
        assert_eq!(w.grad_of, [0, 1]);
        assert!(w.differentiable(0));
        assert!(!w.differentiable(1), "rstd's gradient is not taken");
    }

    #[test]
    fn unnamed_returns_are_out() {
        let w =
            wiring("scale(Tensor x, float s) -> Tensor", "scale_backward(Tensor dout, float s) -> Tensor dx").unwrap();
        assert_eq!(w.sources, [Source::Grad(0), Source::Arg(1)]);
    }

    #[test]
    fn names_outside_the_convention_are_refused_by_name() {
        let forward = "f(Tensor x, float s) -> Tensor y";
        let message = |backward| wiring(forward, backward).unwrap_err().message().to_string();
        let m = message("f_backward(Tensor dy, Tensor z) -> Tensor dx");
        assert!(m.contains("backward op f_backward of f: argument 'z'"), "{m}");
        let m = message("f_backward(Tensor dy) -> Tensor dz");
        assert!(m.contains("return 'dz' is not d<tensor argument of f>"), "{m}");
        let m = message("f_backward(Tensor dy) -> Tensor ds");
        assert!(m.contains("return 'ds'"), "a float argument has no gradient: {m}");
        let lists = wiring("split(Tensor x) -> Tensor[] parts", "split_backward(Tensor[] dparts) -> Tensor dx");
        assert!(lists.unwrap_err().message().contains("returns a list of tensors"));
    }
}
