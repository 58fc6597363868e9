//! A deterministic stand-in for one optimizer step, so demos and tests can make version N+1 from
//! version N and anyone can recompute it.
//!
//! The update depends only on each element's value and the step number (never on its position),
//! so it commutes with slicing: updating a shard equals slicing the updated full tensor.
//!
//! Floats: `x' = x * (1 + s * 3/64) + s * 3/256`, with `s = +-1` from a hash of the value's bits and
//! the step (the same `s` in both terms); computed in f32 (f64 for F64) and rounded to nearest even
//! (bf16/f16 via the `half` crate). Both constants are exact binary fractions. Integers and FP8
//! bytes: wrapping add of the step (in the low byte for FP8).
//!
//! The amplitude is chosen to be visible in greedy decoding, so a demo or test can tell versions
//! apart by their tokens, not just by their logits: on SmolLM2-135M with the prompt "The capital of
//! France is" (token ids `[504, 3575, 282, 4649, 314]`), version 1 (the checkpoint) decodes
//! " Paris" first, version 2 " France" (logit margin about 1.7 over the runner-up) and version 3
//! another first token again (margin about 1.2). A 5% multiplicative part alone, or an additive part
//! alone up to `2^-7`, leaves " Paris" first. Later versions drift further from the
//! checkpoint (the text degrades) but the values stay finite.

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

/// Relative amplitude of the multiplicative part (`3/64`, exact in binary).
const REL: f32 = 3.0 / 64.0;
/// Amplitude of the additive part (`3/256`, exact in binary).
const ABS: f32 = 3.0 / 256.0;

fn f(x: f32, bits: u64, step: u32) -> f32 {
    let s = sign(bits, step);
    x * (1.0 + s * REL) + s * ABS
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
                let s = f64::from(sign(b, step));
                let y = x * (1.0 + s * f64::from(REL)) + s * f64::from(ABS);
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

    #[test]
    fn floats_follow_the_documented_formula() {
        // F32: exactly x * (1 + s * 3/64) + s * 3/256 for s = +1 or -1, both signs occurring.
        let xs = [0.0f32, 1.0, -1.0, 0.5, -0.03125, 2.0, 0.1, -7.25, 3.0, 0.75];
        let mut bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        training_step(DType::F32, &mut bytes, 2);
        let mut signs = [0usize; 2];
        for (x, c) in xs.iter().zip(bytes.chunks_exact(4)) {
            let y = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let plus = x * (1.0 + 3.0 / 64.0) + 3.0 / 256.0;
            let minus = x * (1.0 - 3.0 / 64.0) - 3.0 / 256.0;
            assert!(y == plus || y == minus, "{x} -> {y}");
            signs[usize::from(y == plus)] += 1;
        }
        assert!(signs[0] > 0 && signs[1] > 0, "{signs:?}");

        // BF16: the f32 result rounded to nearest even. From 1.0: 1 + 15/256 lies halfway between
        // the bf16 neighbours 1 + 7/128 and 1 + 8/128 and goes to the even one; 1 - 15/256 is exact.
        let mut one = bf16::from_f32(1.0).to_bits().to_le_bytes();
        training_step(DType::BF16, &mut one, 2);
        let y = bf16::from_bits(u16::from_le_bytes(one)).to_f32();
        assert!(y == 1.0625 || y == 0.941_406_25, "{y}");

        // F16 rounds too, and a step is deterministic.
        let src: Vec<u8> = [0.25f32, -3.0, 0.0]
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
            .collect();
        let (mut a, mut b) = (src.clone(), src.clone());
        training_step(DType::F16, &mut a, 3);
        training_step(DType::F16, &mut b, 3);
        assert_eq!(a, b);
        for (x, c) in [0.25f32, -3.0, 0.0].iter().zip(a.chunks_exact(2)) {
            let y = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            let plus = f16::from_f32(x * (1.0 + 3.0 / 64.0) + 3.0 / 256.0).to_f32();
            let minus = f16::from_f32(x * (1.0 - 3.0 / 64.0) - 3.0 / 256.0).to_f32();
            assert!(y == plus || y == minus, "{x} -> {y}");
        }

        // F64 in f64 arithmetic.
        let mut d = 0.1f64.to_le_bytes();
        training_step(DType::F64, &mut d, 2);
        let y = f64::from_le_bytes(d);
        let plus = 0.1 * (1.0 + 3.0 / 64.0) + 3.0 / 256.0;
        let minus = 0.1 * (1.0 - 3.0 / 64.0) - 3.0 / 256.0;
        assert!(y == plus || y == minus, "{y}");
    }

    #[test]
    fn integers_and_fp8_add_the_step_to_the_low_byte() {
        let mut i = 5i32.to_le_bytes();
        training_step(DType::I32, &mut i, 2);
        assert_eq!(i32::from_le_bytes(i), 7);
        let mut f8 = [0x10u8, 0xFF];
        training_step(DType::F8E4M3, &mut f8, 3);
        assert_eq!(f8, [0x13, 0x02]);
        // Trailing bytes that do not form an element stay.
        let mut odd = [1u8, 2, 3];
        training_step(DType::I16, &mut odd, 4);
        assert_eq!(odd, [5, 2, 3]);
    }
}
