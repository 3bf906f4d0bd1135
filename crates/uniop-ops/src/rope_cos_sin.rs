//! `rope_cos_sin(positions, dim, theta=10000, mode='half', dtype=None, inv_freq=None, per_pair=False,
//! scale=1.0) -> (cos, sin)`:
//! the tables `rope` takes, built the way HF's rotary embeddings build them, so callers need no
//! Python math.
//!
//! `inv_freq[j] = 1 / theta^(2j/dim)` (rounded to f32), `angle = f32(position) · inv_freq[j]` in
//! f32 — the same rounding steps as HF, which matter at long positions — then cos/sin of that
//! angle. A given `inv_freq` (f32 `[dim/2]`) replaces the computed one: HF's scaled ropes (linear,
//! llama3) are this formula with their own frequencies, and even HF's default table is not always
//! ours bit for bit (torch's f32 `pow` is not correctly rounded: at head dim 128 it differs from
//! the rounded exact value in ~19 of 64 frequencies by an ulp, which moves angles at position p by
//! up to p·inv_freq·2⁻²³). Passing the model's own table gives its angles exactly. `scale`
//! multiplies both tables (in f32, before they are rounded to `dtype`): HF's YaRN scales them by
//! its `attention_factor`, so a YaRN model's tables are its `inv_freq` and that factor.
//!
//! Layout of the last dim: `half` repeats the `dim/2` frequencies twice (`cat(freqs, freqs)`),
//! `interleave` repeats each one in place (`repeat_interleave(2)`). With `per_pair`, each frequency
//! is one column (`dim/2` wide, either mode): `rope`'s per-pair tables, read at half the bytes.

use crate::math;
use crate::rope::Mode;
use uniop::{
    block_dim_for, with_float_dtype, AttrValue, BlockCtx, DType, Element, ErrorCode, Example, FloatElement, KernelArgs,
    LayoutNeed, Op, OpCx, Plan, RefTensor, Result, Step, TensorMeta,
};

pub struct RopeCosSin;

struct Table {
    dim: usize,
    mode: Mode,
    /// One column per frequency (`dim / 2` wide).
    per_pair: bool,
    /// Multiplies both tables.
    scale: f32,
    /// From `theta`; empty when the caller gives `inv_freq` (read at launch: plans are reused
    /// across calls with other tensors).
    inv_freq: Vec<f32>,
    dtype: DType,
}

/// The checked arguments, without the frequency table ([`table`] builds it; `infer` needs none).
fn checked(cx: &OpCx) -> Result<Table> {
    let pos = cx.input("positions");
    if !matches!(pos.dtype, DType::I32 | DType::I64) {
        return Err(cx.err(ErrorCode::DType, "positions", "dtype int32 or int64", pos.dtype));
    }
    let dim = cx.int("dim");
    if dim <= 0 || dim % 2 != 0 {
        return Err(cx.err(ErrorCode::ParamInvalid, "dim", "a positive even rotary dim", dim));
    }
    let theta = cx.float("theta");
    if !(theta.is_finite() && theta > 1.0) {
        return Err(cx.err(ErrorCode::ParamInvalid, "theta", "a finite base > 1", theta));
    }
    let mode = match cx.attr("mode") {
        AttrValue::Str(s) if s == "half" => Mode::Half,
        AttrValue::Str(s) if s == "interleave" => Mode::Interleave,
        other => return Err(cx.err(ErrorCode::ParamInvalid, "mode", "'half' or 'interleave'", other)),
    };
    let dtype = match cx.attr("dtype") {
        AttrValue::DType(d) => *d,
        _ => DType::F32,
    };
    if !crate::rope::DTYPES.contains(&dtype) {
        return Err(cx.err(ErrorCode::DType, "dtype", "float32, float16 or bfloat16", dtype));
    }
    let dim = dim as usize;
    if cx.optional_input("inv_freq").is_some() {
        cx.expect_dtype_in("inv_freq", &[DType::F32])?;
        cx.expect_shape("inv_freq", &[dim / 2])?;
    }
    let per_pair = matches!(cx.attr("per_pair"), AttrValue::Bool(true));
    let scale = cx.float("scale");
    if !(scale as f32).is_finite() {
        return Err(cx.err(ErrorCode::ParamInvalid, "scale", "a finite float32 factor", scale));
    }
    Ok(Table { dim, mode, per_pair, scale: scale as f32, inv_freq: Vec::new(), dtype })
}

/// [`checked`] with the frequencies from `theta` when the caller gives no `inv_freq`. The table
/// (`dim / 2` f32) is reserved fallibly: `dim` comes from the caller, and `infer` only checks that
/// the tables have a size — any dim does for no positions — so a table that cannot be allocated
/// must be an error, not an abort.
fn table(cx: &OpCx) -> Result<Table> {
    let mut t = checked(cx)?;
    if cx.optional_input("inv_freq").is_some() {
        return Ok(t);
    }
    let (half, theta) = (t.dim / 2, cx.float("theta"));
    t.inv_freq.try_reserve_exact(half).map_err(|_| {
        let bytes = half as u128 * 4;
        cx.err(
            ErrorCode::Runtime,
            "dim",
            format!("a rotary dim whose {bytes}-byte frequency table fits in memory"),
            t.dim,
        )
    })?;
    t.inv_freq.extend((0..half).map(|j| (1.0 / theta.powf(2.0 * j as f64 / t.dim as f64)) as f32));
    Ok(t)
}

impl Table {
    /// The tables' last dim.
    fn width(&self) -> usize {
        if self.per_pair {
            self.dim / 2
        } else {
            self.dim
        }
    }

    /// Frequency index of column `k`.
    fn freq(&self, k: usize) -> usize {
        match (self.per_pair, self.mode) {
            (true, _) => k,
            (false, Mode::Half) => k % (self.dim / 2),
            (false, Mode::Interleave) => k / 2,
        }
    }

    /// The columns of frequency `j` (the inverse of [`Table::freq`]): one per pair, else two.
    fn columns(&self, j: usize) -> impl Iterator<Item = usize> {
        let (columns, n) = match (self.per_pair, self.mode) {
            (true, _) => ([j, j], 1),
            (false, Mode::Half) => ([j, j + self.dim / 2], 2),
            (false, Mode::Interleave) => ([2 * j, 2 * j + 1], 2),
        };
        columns.into_iter().take(n)
    }

    /// The f32 angle HF computes for `position` and column `k` with frequencies `inv_freq`.
    fn angle(&self, inv_freq: &[f32], position: f64, k: usize) -> f32 {
        position as f32 * inv_freq[self.freq(k)]
    }
}

crate::simd_kernel! {
/// Each row's `dim / 2` angles take one [`math::sin_cos`] each, `LANES` at a time, and land in
/// both columns of their frequency. A row whose angles pass [`math::SIN_COS_MAX`] (positions past
/// ~1.5M at `inv_freq` 1) takes std's sin/cos instead.
fn kernel<P: Element, T: FloatElement>(args: &KernelArgs, ctx: BlockCtx, t: &Table) {
    const LANES: usize = 16;
    let pos = args.input(0);
    let ps = pos.storage::<P>().expect("dtype dispatched");
    let (cos, sin) = (args.output(0), args.output(1));
    let (half, width) = (t.dim / 2, t.width());
    let given = args.optional_input(1);
    let inv_freq = match &given {
        // Dense (the plan asks for it), `dim / 2` long (checked when planned).
        Some(f) => &f.storage::<f32>().expect("checked when planned")[f.layout().offset()..][..half],
        None => &t.inv_freq[..],
    };
    // By magnitude: a caller's table may hold negative frequencies.
    let largest_freq = inv_freq.iter().fold(0f32, |m, &f| m.max(f.abs()));
    let (mut c_lanes, mut s_lanes) = ([0f32; LANES], [0f32; LANES]);
    for row in ctx.split(pos.layout().numel()) {
        let p = ps[pos.layout().offset_of_linear(row)].to_f64() as f32;
        let exact = (p.abs() * largest_freq) as f64 <= math::SIN_COS_MAX;
        // SAFETY: this block owns rows `split(positions)` of both tables.
        let (c, s) = unsafe {
            (
                cos.slice_mut::<T>(cos.layout().offset() + row * width, width),
                sin.slice_mut::<T>(sin.layout().offset() + row * width, width),
            )
        };
        for j0 in (0..half).step_by(LANES) {
            let w = LANES.min(half - j0);
            let freqs = &inv_freq[j0..j0 + w];
            if exact {
                for ((f, cl), sl) in freqs.iter().zip(&mut c_lanes).zip(&mut s_lanes) {
                    let (sv, cv) = math::sin_cos((p * f) as f64);
                    (*cl, *sl) = (cv as f32, sv as f32);
                }
            } else {
                for ((f, cl), sl) in freqs.iter().zip(&mut c_lanes).zip(&mut s_lanes) {
                    let a = (p * f) as f64;
                    (*cl, *sl) = (a.cos() as f32, a.sin() as f32);
                }
            }
            for i in 0..w {
                let (cv, sv) = (T::from_f32(c_lanes[i] * t.scale), T::from_f32(s_lanes[i] * t.scale));
                for k in t.columns(j0 + i) {
                    (c[k], s[k]) = (cv, sv);
                }
            }
        }
    }
}
}

fn step<P: Element>(cx: &OpCx, t: std::sync::Arc<Table>, block_dim: u32) -> Result<Step> {
    Ok(with_float_dtype!(t.dtype, cx.op(), "dtype", |T| {
        Step::new("rope_cos_sin", block_dim, move |args, ctx| kernel::<P, T>(args, ctx, &t))
    }))
}

impl Op for RopeCosSin {
    fn schema(&self) -> &'static str {
        "rope_cos_sin(Tensor positions, int dim, float theta=10000.0, str mode='half', ScalarType? dtype=None, \
         Tensor? inv_freq=None, bool per_pair=False, float scale=1.0) -> (Tensor cos, Tensor sin)"
    }

    fn doc(&self) -> &'static str {
        "cos/sin tables for rope from integer positions (any shape; output [..., dim]), HF's default rotary \
         embedding: inv_freq = 1/theta^(2j/dim), angle = position * inv_freq in float32. mode 'half' lays the \
         dim/2 frequencies out twice (cat), 'interleave' repeats each in place. dtype: float32 (default), float16, bfloat16. \
         inv_freq (float32 [dim/2], optional) replaces 1/theta^(2j/dim): a model's own table (HF's scaled ropes, or \
         its default one as torch's pow rounded it) gives its angles exactly. per_pair: one column per frequency \
         (output [..., dim/2], either mode), rope's per_pair tables. scale multiplies both tables in float32 \
         (HF YaRN's attention factor)."
    }

    fn dtypes(&self) -> &'static [DType] {
        &[DType::I64, DType::I32]
    }

    /// Each position gives its own row of the tables: a batch of positions is one call, its tables
    /// batched alike. (`dim` is the rotary dim, not an axis.)
    fn core_dims(&self) -> &'static [(&'static str, usize)] {
        &[("positions", 0)]
    }

    fn infer(&self, cx: &OpCx) -> Result<Vec<TensorMeta>> {
        let t = checked(cx)?;
        let positions = cx.input("positions").shape();
        let shape = [positions, &[t.width()]].concat();
        let meta = TensorMeta::contiguous(t.dtype, &shape).map_err(|_| {
            let last = if t.per_pair { "dim/2" } else { "dim" };
            let dims: Vec<String> = positions.iter().map(usize::to_string).chain([last.to_string()]).collect();
            let tables = dims.join(", ");
            cx.err(ErrorCode::Shape, "dim", format!("a rotary dim for which the tables [{tables}] have a size"), t.dim)
        })?;
        Ok(vec![meta.clone(), meta])
    }

    fn plan(&self, cx: &OpCx) -> Result<Plan> {
        let t = std::sync::Arc::new(table(cx)?);
        let n = cx.input("positions").numel();
        let block_dim = block_dim_for(n, t.width() * 2 * t.dtype.size());
        let step = match cx.input("positions").dtype {
            DType::I32 => step::<i32>(cx, t, block_dim)?,
            _ => step::<i64>(cx, t, block_dim)?,
        };
        Ok(Plan::new(vec![step])
            .inputs_need(vec![LayoutNeed::Any, LayoutNeed::Contiguous])
            .outputs_need(vec![LayoutNeed::Contiguous; 2]))
    }

    fn reference(&self, cx: &OpCx, inputs: &[Option<RefTensor>]) -> Result<Vec<RefTensor>> {
        let t = table(cx)?;
        let pos = inputs[0].as_ref().unwrap();
        let given =
            inputs.get(1).and_then(Option::as_ref).map(|f| f.data.iter().map(|&v| v as f32).collect::<Vec<_>>());
        let inv_freq = given.as_deref().unwrap_or(&t.inv_freq);
        let mut shape = pos.shape.clone();
        shape.push(t.width());
        let (mut c, mut s) = (Vec::new(), Vec::new());
        for &p in &pos.data {
            for k in 0..t.width() {
                let a = t.angle(inv_freq, p, k) as f64;
                c.push(a.cos() * t.scale as f64);
                s.push(a.sin() * t.scale as f64);
            }
        }
        Ok(vec![RefTensor::new(&shape, c), RefTensor::new(&shape, s)])
    }

    fn example(&self, shape: Option<&[usize]>, dtype: DType) -> Result<Example> {
        let positions = TensorMeta::contiguous(dtype, shape.unwrap_or(&[1, 2048]))?;
        Ok(Example {
            inputs: vec![Some(positions), None],
            attrs: vec![("dim".to_string(), AttrValue::Int(128))],
            ..Default::default()
        })
    }
}
