//! A deterministic stand-in for one optimizer step, so demos and tests can make version N+1 from
//! version N and anyone can recompute it.
//!
//! The update depends only on each element's value and the step number (never on its position),
//! so it commutes with slicing: updating a shard equals slicing the updated full tensor.
//! Floats: `x' = x * (1 - 2^-7) + s * 2^-10`, with `s = +-1` from a hash of the value's bits and
//! the step; computed in f32 and rounded to nearest even (bf16/f16 via the `half` crate). Integers
//! and FP8 bytes: wrapping add of the step (in the low byte for FP8).

use half::{bf16, f16};

use crate::DType;

fn sign(bits: u64, step: u32) -> f32 {
    let h = (bits ^ u64::from(step).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    if (h >> 61) & 1 == 1 {
        1.0
    } else {
        -1.0
    }
}

fn f(x: f32, bits: u64, step: u32) -> f32 {
    x * (1.0 - 1.0 / 128.0) + sign(bits, step) / 1024.0
}

/// Applies training step `step` in place to `bytes`, a row-major array of `dtype` elements.
/// Trailing bytes that do not form a whole element are left unchanged.
pub fn training_step(dtype: DType, bytes: &mut [u8], step: u32) {
    match dtype {
        DType::BF16 => {
            for c in bytes.chunks_exact_mut(2) {
                let b = u16::from_le_bytes([c[0], c[1]]);
                let y = bf16::from_f32(f(bf16::from_bits(b).to_f32(), u64::from(b), step));
                c.copy_from_slice(&y.to_bits().to_le_bytes());
            }
        }
        DType::F16 => {
            for c in bytes.chunks_exact_mut(2) {
                let b = u16::from_le_bytes([c[0], c[1]]);
                let y = f16::from_f32(f(f16::from_bits(b).to_f32(), u64::from(b), step));
                c.copy_from_slice(&y.to_bits().to_le_bytes());
            }
        }
        DType::F32 => {
            for c in bytes.chunks_exact_mut(4) {
                let b = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                let y = f(f32::from_bits(b), u64::from(b), step);
                c.copy_from_slice(&y.to_le_bytes());
            }
        }
        DType::F64 => {
            for c in bytes.chunks_exact_mut(8) {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                let b = u64::from_le_bytes(a);
                let x = f64::from_bits(b);
                let y = x * (1.0 - 1.0 / 128.0) + f64::from(sign(b, step)) / 1024.0;
                c.copy_from_slice(&y.to_le_bytes());
            }
        }
        _ => {
            let es = dtype.size_bytes() as usize;
            for c in bytes.chunks_exact_mut(es) {
                c[0] = c[0].wrapping_add(step as u8);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commutes_with_slicing_and_changes_values() {
        let vals: Vec<u8> = (0..64u16)
            .flat_map(|i| {
                bf16::from_f32(f32::from(i) * 0.37 - 3.0)
                    .to_bits()
                    .to_le_bytes()
            })
            .collect();
        let mut whole = vals.clone();
        training_step(DType::BF16, &mut whole, 2);
        let mut part = vals[20..40].to_vec();
        training_step(DType::BF16, &mut part, 2);
        assert_eq!(&whole[20..40], &part[..]);
        let changed = whole
            .chunks(2)
            .zip(vals.chunks(2))
            .filter(|(a, b)| a != b)
            .count();
        assert!(changed >= 60, "{changed} of 64 changed");
    }
}
