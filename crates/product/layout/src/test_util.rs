//! Test helpers shared by the layout tests: every element of a rank's parameter, tagged with the
//! checkpoint element it is made of.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

use crate::RankLayout;

/// (tensor name, row-major index in it): what an element of a rank buffer came from.
pub(crate) type Tag = (String, u64);

/// Every element of parameter `name` on `r`, tagged with its source, read from the pieces.
pub(crate) fn assembled(r: &RankLayout, name: &str) -> Vec<Tag> {
    let p = r
        .param(name)
        .unwrap_or_else(|| panic!("no {name} on rank {}", r.rank));
    let mut out = Vec::new();
    for pc in &p.pieces {
        let g = &pc.global_shape;
        let b = &pc.region;
        // Row-major walk over the box.
        let n = b.numel().unwrap();
        for k in 0..n {
            let mut rem = k;
            let mut idx = vec![0u64; g.len()];
            for d in (0..g.len()).rev() {
                idx[d] = b.global_offset[d] + rem % b.local_shape[d];
                rem /= b.local_shape[d];
            }
            let lin = idx.iter().zip(g).fold(0u64, |a, (&i, &s)| a * s + i);
            out.push((pc.tensor.clone(), lin));
        }
    }
    let numel: u64 = p.shape.iter().product();
    assert_eq!(
        out.len() as u64,
        numel,
        "{name}: pieces vs shape {:?}",
        p.shape
    );
    out
}
