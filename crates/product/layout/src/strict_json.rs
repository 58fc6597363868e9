//! Strict JSON: what mx parses from outside (safetensors headers, the checkpoint index,
//! `config.json`, manifests, journal records) goes through here, so that an object repeating a
//! key is refused with [`JsonError::DuplicateKey`] naming the key and where it is, instead of
//! serde_json's silent last-one-wins for maps (and first-one-wins or an error for struct fields,
//! depending on the type). Keys are compared after unescaping: `"a"` and `"\u0061"` are the same
//! key.
//!
//! [`check`] walks the document once without building it; [`from_slice`] and [`from_str`] check
//! and then deserialize with serde_json, so every typed parser keeps its own serde derive.

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, SeqAccess, Visitor};

/// Why a JSON document was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JsonError {
    /// An object holds the same key twice (compared after unescaping).
    #[error("duplicate key {key:?} in the object at {path}")]
    DuplicateKey {
        /// The repeated key, unescaped.
        key: String,
        /// Where the object is: `$` for the top level, then `.key` and `[index]` steps.
        path: String,
    },
    /// Not JSON, or JSON of the wrong shape for the type asked for (serde_json's message, with
    /// its line and column).
    #[error("{reason}")]
    Invalid {
        /// serde_json's message.
        reason: String,
    },
}

impl JsonError {
    /// The repeated key, when this is [`JsonError::DuplicateKey`].
    pub fn duplicate_key(&self) -> Option<&str> {
        match self {
            JsonError::DuplicateKey { key, .. } => Some(key),
            JsonError::Invalid { .. } => None,
        }
    }
}

/// A JSON value's kind for messages: `null`, `a boolean`, `a number`, `a string`, `an array`,
/// `an object`.
pub fn kind(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Checks that `bytes` is one JSON value (whitespace around it only) whose objects repeat no
/// key.
///
/// # Errors
/// [`JsonError::DuplicateKey`] for the first repeated key; [`JsonError::Invalid`] when the bytes
/// are not JSON.
pub fn check(bytes: &[u8]) -> Result<(), JsonError> {
    let dup = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let walk = Walk {
        at: &Step::Root,
        dup: &dup,
    };
    let res = walk.deserialize(&mut de).and_then(|()| de.end());
    match (res, dup.into_inner()) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some((key, path))) => Err(JsonError::DuplicateKey { key, path }),
        (Err(e), None) => Err(JsonError::Invalid {
            reason: e.to_string(),
        }),
    }
}

/// [`check`]s `bytes`, then deserializes them as `T`.
///
/// # Errors
/// As [`check`]; [`JsonError::Invalid`] when the JSON is not a `T`.
pub fn from_slice<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, JsonError> {
    check(bytes)?;
    serde_json::from_slice(bytes).map_err(|e| JsonError::Invalid {
        reason: e.to_string(),
    })
}

/// [`from_slice`] over text.
///
/// # Errors
/// As [`from_slice`].
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, JsonError> {
    from_slice(text.as_bytes())
}

/// Where the walk is, rendered only for an error.
enum Step<'a> {
    Root,
    Key(&'a Step<'a>, &'a str),
    Index(&'a Step<'a>, usize),
}

impl fmt::Display for Step<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Root => f.write_str("$"),
            Step::Key(up, k) => write!(f, "{up}.{k}"),
            Step::Index(up, i) => write!(f, "{up}[{i}]"),
        }
    }
}

/// Visits one value, recursing into arrays and objects; serde_json bounds the depth (128).
struct Walk<'a> {
    at: &'a Step<'a>,
    dup: &'a RefCell<Option<(String, String)>>,
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        loop {
            let at = Step::Index(self.at, i);
            let next = Walk {
                at: &at,
                dup: self.dup,
            };
            if seq.next_element_seed(next)?.is_none() {
                return Ok(());
            }
            i += 1;
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen: HashSet<String> = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if seen.contains(&key) {
                let msg = format!("duplicate key {key:?}");
                *self.dup.borrow_mut() = Some((key, self.at.to_string()));
                return Err(de::Error::custom(msg));
            }
            let at = Step::Key(self.at, &key);
            map.next_value_seed(Walk {
                at: &at,
                dup: self.dup,
            })?;
            seen.insert(key);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // reason: tests

    use super::*;

    #[test]
    fn duplicate_key_is_refused_naming_it() {
        let err = check(br#"{"a": 1, "b": {"c": 2, "c": 3}}"#).unwrap_err();
        match err {
            JsonError::DuplicateKey { key, path } => {
                assert_eq!(key, "c");
                assert_eq!(path, "$.b");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn duplicate_key_after_unescaping_is_refused() {
        let err = from_slice::<serde_json::Value>(br#"{"a": 1, "\u0061": 2}"#).unwrap_err();
        assert_eq!(err.duplicate_key(), Some("a"), "{err}");
        assert!(err.to_string().contains("\"a\""), "{err}");
        let err = check(br#"[{"x\/y": 1}, {"k": 0, "x/y": 1, "x\/y": 2}]"#).unwrap_err();
        assert!(
            matches!(&err, JsonError::DuplicateKey { key, path } if key == "x/y" && path == "$[1]"),
            "{err:?}"
        );
    }

    #[test]
    fn typed_structs_are_checked_too() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)] // reason: only parsed
        struct S {
            a: u32,
        }
        // serde's derive keeps the first of an unknown repeated field and errors on a known one
        // with its own wording; strict parsing names the key either way.
        let err = from_str::<S>(r#"{"a": 1, "z": 1, "z": 2}"#).unwrap_err();
        assert_eq!(err.duplicate_key(), Some("z"));
        let err = from_str::<S>(r#"{"a": 1, "a": 2}"#).unwrap_err();
        assert_eq!(err.duplicate_key(), Some("a"));
    }

    #[test]
    fn valid_json_passes_and_garbage_is_invalid() {
        let v: serde_json::Value = from_str(r#"{"a": [1, {"a": 2}], "b": {"a": null}}"#).unwrap();
        assert_eq!(v["a"][1]["a"], 2);
        assert!(matches!(
            check(b"{\"a\": 1} x").unwrap_err(),
            JsonError::Invalid { .. }
        ));
        assert!(matches!(
            check(b"{\"a\": ").unwrap_err(),
            JsonError::Invalid { .. }
        ));
        // serde_json's recursion limit holds: deep nesting is an error, not a stack overflow.
        let deep = "[".repeat(100_000);
        assert!(matches!(
            check(deep.as_bytes()).unwrap_err(),
            JsonError::Invalid { .. }
        ));
    }
}
