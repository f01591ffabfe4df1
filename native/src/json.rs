//! Strict JSON (no repeated keys; serde_json already refuses NaN/Infinity and trailing
//! text) and typed field access whose errors name the field's path.

use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Parses one JSON document, refusing an object that repeats a key.
pub fn parse_strict(text: &str) -> Result<Value, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    let Strict(value) = Strict::deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok(value)
}

/// Reads a JSON file of at most `max_len` bytes and parses it strictly.
pub fn read_strict(path: &std::path::Path, max_len: u64) -> Result<Value, String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("cannot read: {e}"))?
        .len();
    if len > max_len {
        return Err(format!("{len} bytes, over the {max_len}-byte limit"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read as UTF-8: {e}"))?;
    parse_strict(&text).map_err(|e| format!("not valid JSON: {e}"))
}

struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Strict, D::Error> {
        deserializer.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }
    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Strict(Value::Bool(v)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Strict, E> {
        Ok(Strict(Value::Number(v.into())))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Strict, E> {
        Ok(Strict(Value::Number(v.into())))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Strict, E> {
        Number::from_f64(v)
            .map(|n| Strict(Value::Number(n)))
            .ok_or_else(|| E::custom("non-finite number"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Strict(Value::String(v.to_string())))
    }
    fn visit_string<E>(self, v: String) -> Result<Strict, E> {
        Ok(Strict(Value::String(v)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Strict(Value::Array(items)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Strict, A::Error> {
        let mut map = Map::new();
        while let Some(key) = access.next_key::<String>()? {
            let Strict(value) = access.next_value()?;
            if map.insert(key.clone(), value).is_some() {
                return Err(A::Error::custom(format!("repeated key {key:?}")));
            }
        }
        Ok(Strict(Value::Object(map)))
    }
}

/// A short rendering of a value for error messages.
pub fn show(value: &Value) -> String {
    let text = value.to_string();
    if text.chars().count() > 60 {
        format!("{}...", text.chars().take(57).collect::<String>())
    } else {
        text
    }
}

/// A JSON object with the dotted path it was reached by, for error messages.
#[derive(Clone, Copy)]
pub struct Obj<'a> {
    pub path: &'a str,
    pub map: &'a Map<String, Value>,
}

impl<'a> Obj<'a> {
    pub fn root(value: &'a Value, what: &'a str) -> Result<Obj<'a>, String> {
        value
            .as_object()
            .map(|map| Obj { path: "", map })
            .ok_or_else(|| format!("{what} is not a JSON object"))
    }

    pub fn field_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    fn expected(&self, key: &str, what: &str, found: &Value) -> String {
        format!(
            "{}: expected {what}, found {}",
            self.field_path(key),
            show(found)
        )
    }

    pub fn get(&self, key: &str) -> Result<&'a Value, String> {
        self.map
            .get(key)
            .ok_or_else(|| format!("{}: missing", self.field_path(key)))
    }

    pub fn opt(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    /// A nested object; `path` must outlive it, so the caller keeps the path string.
    pub fn obj(&self, key: &str, path: &'a str) -> Result<Obj<'a>, String> {
        let value = self.get(key)?;
        value
            .as_object()
            .map(|map| Obj { path, map })
            .ok_or_else(|| self.expected(key, "an object", value))
    }

    pub fn str(&self, key: &str) -> Result<&'a str, String> {
        let value = self.get(key)?;
        value
            .as_str()
            .ok_or_else(|| self.expected(key, "a string", value))
    }

    /// A string or null.
    pub fn str_or_null(&self, key: &str) -> Result<Option<&'a str>, String> {
        match self.get(key)? {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(s)),
            other => Err(self.expected(key, "a string or null", other)),
        }
    }

    /// A JSON integer literal >= 0 (a number written with a fraction or exponent is refused).
    pub fn uint(&self, key: &str) -> Result<u64, String> {
        let value = self.get(key)?;
        value
            .as_u64()
            .ok_or_else(|| self.expected(key, "a non-negative integer", value))
    }

    pub fn positive(&self, key: &str) -> Result<usize, String> {
        match self.uint(key)? {
            0 => Err(self.expected(key, "a positive integer", &Value::from(0))),
            n => Ok(n as usize),
        }
    }

    /// Any JSON number, as f64.
    pub fn number(&self, key: &str) -> Result<f64, String> {
        let value = self.get(key)?;
        value
            .as_f64()
            .ok_or_else(|| self.expected(key, "a number", value))
    }

    pub fn bool(&self, key: &str) -> Result<bool, String> {
        let value = self.get(key)?;
        value
            .as_bool()
            .ok_or_else(|| self.expected(key, "true or false", value))
    }

    pub fn array(&self, key: &str) -> Result<&'a Vec<Value>, String> {
        let value = self.get(key)?;
        value
            .as_array()
            .ok_or_else(|| self.expected(key, "an array", value))
    }

    pub fn str_list(&self, key: &str) -> Result<Vec<&'a str>, String> {
        let items = self.array(key)?;
        items
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.expected(key, "an array of strings", v))
            })
            .collect()
    }

    pub fn uint_list(&self, key: &str) -> Result<Vec<u64>, String> {
        let items = self.array(key)?;
        items
            .iter()
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.expected(key, "an array of non-negative integers", v))
            })
            .collect()
    }

    /// Fails unless the string field equals `want` exactly.
    pub fn expect_str(&self, key: &str, want: &str) -> Result<(), String> {
        let value = self.get(key)?;
        if value.as_str() == Some(want) {
            Ok(())
        } else {
            Err(self.expected(key, &format!("{want:?}"), value))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_repeated_keys_at_any_depth() {
        assert!(parse_strict(r#"{"a": 1, "a": 2}"#)
            .unwrap_err()
            .contains("repeated key \"a\""));
        assert!(parse_strict(r#"{"a": [{"b": 1, "b": 1}]}"#).is_err());
        assert!(parse_strict(r#"{"a": {"b": 1}, "b": {"b": 1}}"#).is_ok());
    }

    #[test]
    fn refuses_nan_and_trailing_text() {
        assert!(parse_strict(r#"{"a": NaN}"#).is_err());
        assert!(parse_strict(r#"{"a": Infinity}"#).is_err());
        assert!(parse_strict(r#"{} {}"#).is_err());
        assert!(parse_strict("{}\n").is_ok());
    }

    #[test]
    fn keeps_the_lexical_kind_of_numbers() {
        let v = parse_strict(r#"{"eps": 1e-06, "n": 64, "x": 64.0}"#).unwrap();
        assert!(v["eps"].is_f64() && v["n"].is_u64() && v["x"].is_f64());
    }

    #[test]
    fn typed_access_names_the_path() {
        let v = parse_strict(r#"{"lora": {"rank": "32", "file": null, "ok": 0}}"#).unwrap();
        let root = Obj::root(&v, "manifest").unwrap();
        let lora = root.obj("lora", "lora").unwrap();
        assert_eq!(
            lora.uint("rank").unwrap_err(),
            "lora.rank: expected a non-negative integer, found \"32\""
        );
        assert_eq!(lora.str_or_null("file").unwrap(), None);
        assert_eq!(lora.uint("alpha").unwrap_err(), "lora.alpha: missing");
        assert!(lora.positive("ok").unwrap_err().contains("positive"));
    }
}
