//! Element types and their byte sizes.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// An element type of a weight tensor.
///
/// Names follow the safetensors header spelling (`"BF16"`, `"F8_E4M3"`, ...), which is also what
/// `Display`/`FromStr` use, so a dtype read from a checkpoint round-trips unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DType {
    /// 1-byte boolean.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
    /// FP8 e4m3 (OCP, "fn" variant as in torch.float8_e4m3fn).
    F8E4M3,
    /// FP8 e5m2 (OCP).
    F8E5M2,
}

impl DType {
    /// All dtypes, for tests and property generators.
    pub const ALL: [DType; 12] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The safetensors header name of this dtype.
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I16 => "I16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DType {
    type Err = Error;

    /// Parses a safetensors dtype name (case-insensitive; `float8_e4m3fn`-style torch names too).
    ///
    /// # Errors
    /// [`Error::UnknownDType`] naming the string.
    fn from_str(s: &str) -> Result<Self, Error> {
        let up = s.to_ascii_uppercase();
        let d = match up.as_str() {
            "BOOL" => DType::Bool,
            "U8" | "UINT8" => DType::U8,
            "I8" | "INT8" => DType::I8,
            "I16" | "INT16" => DType::I16,
            "I32" | "INT32" => DType::I32,
            "I64" | "INT64" => DType::I64,
            "F16" | "FLOAT16" => DType::F16,
            "BF16" | "BFLOAT16" => DType::BF16,
            "F32" | "FLOAT32" => DType::F32,
            "F64" | "FLOAT64" => DType::F64,
            "F8_E4M3" | "F8E4M3" | "FLOAT8_E4M3FN" => DType::F8E4M3,
            "F8_E5M2" | "F8E5M2" | "FLOAT8_E5M2" => DType::F8E5M2,
            _ => {
                return Err(Error::UnknownDType {
                    name: s.to_string(),
                })
            }
        };
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes() {
        for d in DType::ALL {
            assert_eq!(d.as_str().parse::<DType>().ok(), Some(d));
        }
        assert_eq!(DType::BF16.size_bytes(), 2);
        assert_eq!(DType::F8E5M2.size_bytes(), 1);
        assert_eq!(DType::F64.size_bytes(), 8);
        assert!(matches!(
            "Q4_1".parse::<DType>(),
            Err(Error::UnknownDType { .. })
        ));
    }
}
