//! Field (de)serializers the wire modules share: the lenient readings of engine answers that mx
//! has always applied (a text field may be a number, a list keeps only its strings, an optional
//! field of an unexpected type reads as absent), and numbers written as integers when integral.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serializer};
use serde_json::Value;

/// A string, or a number kept as its decimal text (`7587888` reads as `"7587888"`).
fn as_text(v: Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A required text field: a string or a number.
pub(crate) fn text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let v = Value::deserialize(d)?;
    let shown = v.to_string();
    as_text(v).ok_or_else(|| {
        serde::de::Error::custom(format!("{shown} is neither a string nor a number"))
    })
}

/// A required field read as text: a string or a number as [`text`]; an object or array as its
/// compact JSON (Dynamo 1.6.1 lists a worker's `transport` as `{"tcp": "<host:port>/..."}`).
pub(crate) fn text_or_json<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let v = Value::deserialize(d)?;
    match v {
        Value::Object(_) | Value::Array(_) => Ok(v.to_string()),
        other => {
            let shown = other.to_string();
            as_text(other).ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "{shown} is neither a string, a number nor an object"
                ))
            })
        }
    }
}

/// An optional text field: a string or a number; anything else (null included) is absent.
pub(crate) fn opt_text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(as_text(Value::deserialize(d)?))
}

/// A text field that reads as empty when it is neither a string nor a number.
pub(crate) fn text_or_empty<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(as_text(Value::deserialize(d)?).unwrap_or_default())
}

/// An optional field of type `T`; a value that is not a `T` (null included) is absent.
pub(crate) fn lenient<'de, D: Deserializer<'de>, T: DeserializeOwned>(
    d: D,
) -> Result<Option<T>, D::Error> {
    Ok(T::deserialize(Value::deserialize(d)?).ok())
}

/// A list of strings: an array keeps its strings (other elements skipped); anything else is
/// absent.
pub(crate) fn opt_string_list<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<String>>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::Array(a) => Some(
            a.into_iter()
                .filter_map(|x| match x {
                    Value::String(s) => Some(s),
                    _ => None,
                })
                .collect(),
        ),
        _ => None,
    })
}

/// Dynamo's route list: each element a string or an object naming the route in `name` (or
/// `route`); other elements are skipped, and anything but an array is no routes.
pub(crate) fn routes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let Value::Array(a) = Value::deserialize(d)? else {
        return Ok(Vec::new());
    };
    Ok(a.into_iter()
        .filter_map(|r| match r {
            Value::String(s) => Some(s),
            Value::Object(mut o) => o
                .remove("name")
                .and_then(as_text)
                .or_else(|| o.remove("route").and_then(as_text)),
            _ => None,
        })
        .collect())
}

/// Writes an integral float as an integer (`0.0` as `0`), as engines' own clients do.
pub(crate) fn number<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if x.fract() == 0.0 && x.abs() < EXACT {
        // Integral and within f64's exact integers: the conversion is exact.
        s.serialize_i64(*x as i64)
    } else {
        s.serialize_f64(*x)
    }
}

/// [`number`] for an optional field (skipped when absent by the field's own attribute).
pub(crate) fn opt_number<S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match x {
        Some(x) => number(x, s),
        None => s.serialize_none(),
    }
}
