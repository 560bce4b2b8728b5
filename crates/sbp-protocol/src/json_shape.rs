//! A pre-scan of JSON text for its shape (nesting depth, number of objects and of values), in one
//! pass over the bytes and without allocating, so a body is refused before it is parsed into a
//! `serde_json::Value` tree. Parsed, every value costs at least 32 bytes whatever its size in the
//! text (`0,` is 2 bytes), and every object hundreds (`{"a":0}` is 7 bytes of JSON and a 600-byte
//! B-tree node): these counts, not the body size, bound the memory of parsing.
//!
//! The scan does not validate: text that is not JSON is left to the parser to reject.

/// What [`scan`] found, when within the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Shape {
    /// The deepest nesting of objects and arrays (`{}` is 1, `[{}]` is 2).
    pub depth: usize,
    /// How many objects the text holds.
    pub objects: usize,
    /// How many values it holds: objects, arrays, strings (keys included), numbers, literals.
    pub values: usize,
}

/// Which limit the text exceeds (the first one met while scanning).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error("JSON nested deeper than {max} levels")]
    TooDeep { max: usize },
    #[error("JSON holds more than {max} objects")]
    TooManyObjects { max: usize },
    #[error("JSON holds more than {max} values")]
    TooManyValues { max: usize },
}

/// The limits [`scan`] holds text to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeLimits {
    pub depth: usize,
    pub objects: usize,
    pub values: usize,
}

/// Scans `text`, stopping at the first limit exceeded.
pub fn scan(text: &[u8], max: ShapeLimits) -> Result<Shape, ShapeError> {
    let mut shape = Shape::default();
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    // Inside a number or literal (`true`, `12.5e3`): its first byte counted it.
    let mut in_scalar = false;
    let value = |shape: &mut Shape| {
        shape.values += 1;
        if shape.values > max.values {
            return Err(ShapeError::TooManyValues { max: max.values });
        }
        Ok(())
    };
    for &b in text {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => {
                in_string = true;
                in_scalar = false;
                value(&mut shape)?;
            }
            b'{' | b'[' => {
                in_scalar = false;
                value(&mut shape)?;
                depth += 1;
                if depth > max.depth {
                    return Err(ShapeError::TooDeep { max: max.depth });
                }
                shape.depth = shape.depth.max(depth);
                if b == b'{' {
                    shape.objects += 1;
                    if shape.objects > max.objects {
                        return Err(ShapeError::TooManyObjects { max: max.objects });
                    }
                }
            }
            b'}' | b']' => {
                in_scalar = false;
                depth = depth.saturating_sub(1);
            }
            b',' | b':' | b' ' | b'\t' | b'\n' | b'\r' => in_scalar = false,
            _ if !in_scalar => {
                in_scalar = true;
                value(&mut shape)?;
            }
            _ => {}
        }
    }
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOMY: ShapeLimits = ShapeLimits {
        depth: 64,
        objects: 100,
        values: 100,
    };

    #[test]
    fn depth_objects_and_values_are_counted_outside_strings() {
        let text = br#"{"a": [{"b": "{[\"}]"}, {}, 12.5e3, true, null], "c": "\\"}"#;
        assert_eq!(
            scan(text, ROOMY),
            Ok(Shape {
                depth: 3,
                objects: 3,
                values: 12,
            })
        );
        assert_eq!(
            scan(b"[]", ROOMY),
            Ok(Shape {
                depth: 1,
                objects: 0,
                values: 1
            })
        );
        assert_eq!(
            scan(b" \"{{{\" ", ROOMY),
            Ok(Shape {
                depth: 0,
                objects: 0,
                values: 1
            })
        );
    }

    #[test]
    fn limits_stop_the_scan() {
        let deep = format!("{}{}", "[".repeat(65), "]".repeat(65));
        assert_eq!(
            scan(deep.as_bytes(), ROOMY),
            Err(ShapeError::TooDeep { max: 64 })
        );
        let deeper = ShapeLimits { depth: 65, ..ROOMY };
        assert!(scan(deep.as_bytes(), deeper).is_ok());
        let many = format!("[{}]", vec!["{}"; 101].join(","));
        assert_eq!(
            scan(
                many.as_bytes(),
                ShapeLimits {
                    values: 1000,
                    ..ROOMY
                }
            ),
            Err(ShapeError::TooManyObjects { max: 100 })
        );
        let numbers = format!("[{}]", vec!["0"; 100].join(","));
        assert_eq!(
            scan(numbers.as_bytes(), ROOMY),
            Err(ShapeError::TooManyValues { max: 100 })
        );
    }
}
