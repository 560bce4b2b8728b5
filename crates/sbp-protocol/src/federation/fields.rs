//! Reading and writing the typed fields of the federation's JSON documents, with errors that name
//! the field (`old_keys[1].expires_at`), and the one spelling of their times (RFC 3339, seconds, `Z`).

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Map, Value};
use uuid::Uuid;

/// A field that is missing or not of its type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {reason}")]
pub struct FieldError {
    /// The path of the field (`endpoints.ws`, `tether[2].seq`).
    pub field: String,
    pub reason: &'static str,
}

impl FieldError {
    pub(crate) fn new(field: impl Into<String>, reason: &'static str) -> Self {
        Self {
            field: field.into(),
            reason,
        }
    }
}

/// How every federation document writes a time: RFC 3339 to the second, UTC as `Z`.
pub fn write_time(t: &DateTime<Utc>) -> Value {
    Value::String(t.to_rfc3339_opts(SecondsFormat::Secs, true))
}

/// The fields of one JSON object, read under a path prefix (`""` at the top, `"old_keys[0]."` inside).
#[derive(Debug)]
pub(crate) struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(obj: &'a Map<String, Value>) -> Self {
        Self {
            obj,
            prefix: String::new(),
        }
    }

    pub(crate) fn nested(obj: &'a Map<String, Value>, prefix: String) -> Self {
        Self { obj, prefix }
    }

    pub(crate) fn path(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn err(&self, name: &str, reason: &'static str) -> FieldError {
        FieldError::new(self.path(name), reason)
    }

    pub(crate) fn get(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name)
    }

    pub(crate) fn required(&self, name: &str) -> Result<&'a Value, FieldError> {
        self.obj
            .get(name)
            .ok_or_else(|| self.err(name, "is missing"))
    }

    /// A string (may be empty).
    pub(crate) fn string(&self, name: &str) -> Result<String, FieldError> {
        match self.required(name)? {
            Value::String(s) => Ok(s.clone()),
            _ => Err(self.err(name, "must be a string")),
        }
    }

    /// A non-empty string: every id and URL.
    pub(crate) fn text(&self, name: &str) -> Result<String, FieldError> {
        let s = self.string(name)?;
        if s.is_empty() {
            return Err(self.err(name, "must not be empty"));
        }
        Ok(s)
    }

    /// A string, or `None` when absent or `null`.
    pub(crate) fn optional_text(&self, name: &str) -> Result<Option<String>, FieldError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(Value::String(_)) => Err(self.err(name, "must not be empty")),
            Some(_) => Err(self.err(name, "must be a string")),
        }
    }

    pub(crate) fn u64(&self, name: &str) -> Result<u64, FieldError> {
        self.required(name)?
            .as_u64()
            .ok_or_else(|| self.err(name, "must be a non-negative integer"))
    }

    pub(crate) fn bool(&self, name: &str) -> Result<bool, FieldError> {
        self.required(name)?
            .as_bool()
            .ok_or_else(|| self.err(name, "must be a boolean"))
    }

    pub(crate) fn uuid(&self, name: &str) -> Result<Uuid, FieldError> {
        // The one spelling of an id (`crate::id`), so a session never has two names.
        crate::id::parse_canonical(&self.string(name)?)
            .ok_or_else(|| self.err(name, "must be a lower-case hyphenated UUID"))
    }

    /// An RFC 3339 time, any offset, read as UTC.
    pub(crate) fn time(&self, name: &str) -> Result<DateTime<Utc>, FieldError> {
        DateTime::parse_from_rfc3339(&self.string(name)?)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|_| self.err(name, "must be an RFC 3339 time"))
    }

    pub(crate) fn array(&self, name: &str) -> Result<&'a Vec<Value>, FieldError> {
        match self.required(name)? {
            Value::Array(items) => Ok(items),
            _ => Err(self.err(name, "must be an array")),
        }
    }

    pub(crate) fn object(&self, name: &str) -> Result<&'a Map<String, Value>, FieldError> {
        match self.required(name)? {
            Value::Object(map) => Ok(map),
            _ => Err(self.err(name, "must be an object")),
        }
    }

    /// The object being read.
    pub(crate) fn map(&self) -> &'a Map<String, Value> {
        self.obj
    }

    /// The objects of the array `name`, each read under its path (`name[i].`).
    pub(crate) fn objects(&self, name: &str) -> Result<Vec<Fields<'a>>, FieldError> {
        self.array(name)?
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let path = self.path(&format!("{name}[{i}]"));
                match item {
                    Value::Object(map) => Ok(Fields::nested(map, format!("{path}."))),
                    _ => Err(FieldError::new(path, "must be an object")),
                }
            })
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // In tests a panic is the failure report.
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn times_are_written_to_the_second_and_read_with_any_offset() {
        let t = DateTime::<Utc>::from_timestamp(1_700_000_000, 123_456_789).unwrap();
        assert_eq!(write_time(&t), json!("2023-11-14T22:13:20Z"));
        let Value::Object(obj) =
            json!({"a": "2023-11-14T23:13:20+01:00", "b": "2023-11-14T22:13:20", "c": 5})
        else {
            unreachable!()
        };
        let f = Fields::new(&obj);
        assert_eq!(f.time("a").unwrap().timestamp(), 1_700_000_000);
        assert_eq!(
            f.time("b"),
            Err(FieldError::new("b", "must be an RFC 3339 time"))
        );
        assert_eq!(f.time("c"), Err(FieldError::new("c", "must be a string")));
        assert_eq!(f.time("d"), Err(FieldError::new("d", "is missing")));
    }

    #[test]
    fn nested_paths_name_the_item() {
        let Value::Object(obj) = json!({"list": [{"n": 1}, 2]}) else {
            unreachable!()
        };
        assert_eq!(
            Fields::new(&obj).objects("list").unwrap_err(),
            FieldError::new("list[1]", "must be an object")
        );
        let Value::Object(obj) = json!({"list": [{"n": -1}]}) else {
            unreachable!()
        };
        let items = Fields::new(&obj).objects("list").unwrap();
        assert_eq!(
            items[0].u64("n"),
            Err(FieldError::new(
                "list[0].n",
                "must be a non-negative integer"
            ))
        );
    }
}
