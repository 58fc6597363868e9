//! Box geometry: the row-major runs of a box inside another, and the intersection of two boxes.

use crate::TensorBox;

/// Row-major runs of `inner` inside a dense row-major `outer` box: (elements per run, start of
/// each run in elements from `outer`'s origin), in row-major order of `inner`.
pub fn decompose(inner: &TensorBox, outer: &TensorBox) -> (u64, Vec<u64>) {
    let n = inner.ndim();
    if n == 0 {
        return (1, vec![0]);
    }
    let mut stride = vec![1u64; n];
    for d in (0..n - 1).rev() {
        stride[d] = stride[d + 1] * outer.local_shape[d + 1];
    }
    let mut k = n - 1;
    while k > 0 && inner.local_shape[k] == outer.local_shape[k] {
        k -= 1;
    }
    let run = inner.local_shape[k] * stride[k];
    let base: u64 = (0..n)
        .map(|d| (inner.global_offset[d] - outer.global_offset[d]) * stride[d])
        .sum();
    let count: u64 = inner.local_shape[..k].iter().product();
    let mut starts = Vec::with_capacity(count as usize);
    let mut idx = vec![0u64; k];
    for _ in 0..count {
        let off: u64 = (0..k).map(|d| idx[d] * stride[d]).sum();
        starts.push(base + off);
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < inner.local_shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    (run, starts)
}

/// Run starts of an inner box inside a dense row-major outer box, in elements from the outer
/// box's origin: what [`decompose`] lists, without the list when the starts are evenly spaced
/// (every box split in at most one dim besides its outermost).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Runs {
    /// `count` runs at `first + i * stride`.
    Arith { first: u64, stride: u64, count: u64 },
    /// Explicit starts.
    List(Vec<u64>),
}

impl Runs {
    pub(super) fn len(&self) -> u64 {
        match self {
            Runs::Arith { count, .. } => *count,
            Runs::List(v) => v.len() as u64,
        }
    }

    /// Start of run `i < len()`.
    pub(super) fn get(&self, i: u64) -> u64 {
        match self {
            Runs::Arith { first, stride, .. } => first.wrapping_add(i.wrapping_mul(*stride)),
            Runs::List(v) => v.get(i as usize).copied().unwrap_or(0),
        }
    }
}

/// [`decompose`] of the box (`io`, `is`) inside the box (`oo`, `os`) (same number of dims), as
/// (elements per run, [`Runs`]). Arithmetic wraps like the release build of [`decompose`].
pub(super) fn runs_in(io: &[u64], is: &[u64], oo: &[u64], os: &[u64]) -> (u64, Runs) {
    let n = is.len();
    if n == 0 || io.len() != n || oo.len() != n || os.len() != n {
        return (
            1,
            Runs::Arith {
                first: 0,
                stride: 0,
                count: 1,
            },
        );
    }
    let mut k = n - 1;
    while k > 0 && is[k] == os[k] {
        k -= 1;
    }
    if k <= 1 {
        // Strides from the innermost dim out; the run is is[k] * stride[k].
        let mut stride = 1u64;
        let mut base = 0u64;
        let (mut stride_k, mut stride_0) = (1u64, 1u64);
        for d in (0..n).rev() {
            if d == k {
                stride_k = stride;
            }
            if d == 0 {
                stride_0 = stride;
            }
            base = base.wrapping_add(io[d].wrapping_sub(oo[d]).wrapping_mul(stride));
            if d > 0 {
                stride = stride.wrapping_mul(os[d]);
            }
        }
        let run = is[k].wrapping_mul(stride_k);
        let (stride, count) = if k == 1 { (stride_0, is[0]) } else { (0, 1) };
        return (
            run,
            Runs::Arith {
                first: base,
                stride,
                count,
            },
        );
    }
    let mut stride = vec![1u64; n];
    for d in (0..n - 1).rev() {
        stride[d] = stride[d + 1].wrapping_mul(os[d + 1]);
    }
    let run = is[k].wrapping_mul(stride[k]);
    let base = (0..n).fold(0u64, |acc, d| {
        acc.wrapping_add(io[d].wrapping_sub(oo[d]).wrapping_mul(stride[d]))
    });
    let count = is[..k].iter().fold(1u64, |a, &x| a.wrapping_mul(x));
    let mut starts = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    let mut idx = vec![0u64; k];
    for _ in 0..count {
        let off = (0..k).fold(0u64, |acc, d| {
            acc.wrapping_add(idx[d].wrapping_mul(stride[d]))
        });
        starts.push(base.wrapping_add(off));
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < is[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    (run, Runs::List(starts))
}

/// Appends the intersection of box (`ao`, `as_`) with box (`bo`, `bs`), as [`TensorBox::intersect`]
/// computes it, to `out` (offset, then shape); false, appending nothing, when empty or malformed.
pub(super) fn intersect_into(
    ao: &[u64],
    as_: &[u64],
    bo: &[u64],
    bs: &[u64],
    out: &mut Vec<u64>,
) -> bool {
    let n = as_.len();
    if bs.len() != n || ao.len() != n || bo.len() != n {
        return false;
    }
    let lo = |d: usize| ao[d].max(bo[d]);
    let hi = |d: usize| (ao[d].saturating_add(as_[d])).min(bo[d].saturating_add(bs[d]));
    if (0..n).any(|d| hi(d) <= lo(d)) {
        return false;
    }
    out.extend((0..n).map(lo));
    out.extend((0..n).map(|d| hi(d) - lo(d)));
    true
}
