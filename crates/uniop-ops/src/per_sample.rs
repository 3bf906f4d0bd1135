//! Sums per sample: the `batch_dims` attribute of the ops that sum over rows.
//!
//! `rms_norm_backward`, `add_rms_norm_backward`, `layer_norm_backward`, `linear_backward`,
//! `linear_add_backward`, `linear_{silu,gelu}_mul_backward` and `embedding_backward` sum dweight
//! (and dbias) over every row of `x` (token of `indices`), `attention_backward` sums dmask and
//! dsinks over every batch row of `q`, and `cross_entropy` takes one mean over all rows: the
//! gradient, the loss, of one batch. Per-sample gradients (`torch.func.vmap(torch.func.grad(..))`,
//! DP-SGD's clipping) want one sum per sample instead, and splitting the total afterwards is impossible, so without
//! help each sample costs a call of its own. With `batch_dims = b` the first `b` dims of `x` count
//! samples: the summed returns come out `x.shape[..b] + the parameter's shape` (a loss: `x.shape[..b]`),
//! one per sample, from one call; the row-wise returns (dx) do not change. `uniop.torch`'s vmap rule
//! moves the vmapped dim to the front and adds one.
//!
//! A sample's rows are contiguous in row order, so a launch deals each sample its own blocks
//! ([`BlockCtx::within`]), each block keeping private partials as before; the sum of the partials
//! then adds a sample's blocks only. `batch_dims = 0` is one sample: the plans of before.

use std::ops::Range;
use uniop::layout::ShapeDisplay;
use uniop::{BlockCtx, ErrorCode, OpCx, Result};

/// How the rows of an op's `x` (logits, indices) divide into samples.
pub(crate) struct Samples {
    /// `x.shape[..batch_dims]`.
    pub dims: Vec<usize>,
    /// How many samples (their dims' product).
    pub count: usize,
    /// Rows per sample.
    pub rows: usize,
}

impl Samples {
    /// Reads `batch_dims` and checks it against `x`, whose first `row_dims` dims index rows.
    pub fn of(cx: &OpCx, x: &str, row_dims: usize) -> Result<Samples> {
        let b = cx.int("batch_dims");
        let shape = cx.input(x).shape();
        if b < 0 || b as usize > row_dims {
            return Err(cx.err(
                ErrorCode::ParamInvalid,
                "batch_dims",
                format!("0 to {row_dims} (the dims of {x} {} that index its rows)", ShapeDisplay(shape)),
                b,
            ));
        }
        let dims = shape[..b as usize].to_vec();
        let count: usize = dims.iter().product();
        // No sample: no rows (the launch still runs one empty sample).
        let rows = if count == 0 { 0 } else { shape[b as usize..row_dims].iter().product() };
        Ok(Samples { dims, count, rows })
    }

    /// The shape of a summed return: the samples' dims, then the parameter's `shape`.
    pub fn shape(&self, param: &[usize]) -> Vec<usize> {
        [&self.dims[..], param].concat()
    }

    /// The launch of `wanted` blocks for one sample, dealt out over the samples: at least one block
    /// each, `wanted` in all where there are fewer samples than that.
    pub fn blocks(&self, cx: &OpCx, x: &str, wanted: u32) -> Result<SampleBlocks> {
        let launched = self.count.max(1);
        let per_sample = (wanted as usize).div_ceil(launched).max(1);
        let too_many = || cx.err(ErrorCode::Shape, x, "at most 2^32 samples (batch_dims)", self.count);
        let total = launched.checked_mul(per_sample).filter(|&t| t <= u32::MAX as usize).ok_or_else(too_many)?;
        Ok(SampleBlocks { count: self.count, rows: self.rows, per_sample, total: total as u32 })
    }
}

/// A launch's blocks dealt out over the samples, `per_sample` each, sample by sample.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SampleBlocks {
    pub count: usize,
    pub rows: usize,
    pub per_sample: usize,
    pub total: u32,
}

impl SampleBlocks {
    /// The sample of this block, and the rows it owns (indices into all rows of `x`).
    #[inline]
    pub fn rows(&self, ctx: BlockCtx) -> (usize, Range<usize>) {
        let (sample, place) = ctx.within(self.count.max(1));
        let own = place.split(self.rows);
        let first = sample * self.rows;
        (sample, first + own.start..first + own.end)
    }
}
