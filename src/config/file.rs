//! The `--config` file: TOML whose keys are the flags' names. Values come out as the text a
//! flag would carry, so one parser serves every source.

use std::path::Path;

use super::{ConfigError, err};

/// A key that no longer exists, named so that an old config gets a useful error.
pub const REPLACED: (&str, &str) = (
    "resolve-latest",
    "replaced by resolve-tags = never | when-upstream-fails | always (latest is no longer special)",
);

/// The file's `(key, text)` pairs. A key not in `known`, or a value that is neither a string,
/// a boolean, an integer nor (for lists) an array of strings, is an error naming the key.
pub fn read(path: &Path, known: &[String]) -> Result<Vec<(String, String)>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| err("config", format!("cannot read {}: {e}", path.display())))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let msg = e.message().to_string();
        err(
            "config",
            format!("{} is not valid TOML: {msg}", path.display()),
        )
    })?;
    let mut values = Vec::new();
    for (key, value) in table {
        if key == REPLACED.0 {
            return Err(err(&key, REPLACED.1));
        }
        if !known.contains(&key) {
            return Err(err(&key, format!("unknown key in {}", path.display())));
        }
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Integer(n) => n.to_string(),
            // Newlines, not commas: a regex may contain commas.
            toml::Value::Array(items) => strings(&key, items)?.join("\n"),
            other => {
                return Err(err(
                    &key,
                    format!("expected a string, found {}", other.type_str()),
                ));
            }
        };
        values.push((key, text));
    }
    Ok(values)
}

fn strings(key: &str, items: Vec<toml::Value>) -> Result<Vec<String>, ConfigError> {
    items
        .into_iter()
        .map(|i| match i {
            toml::Value::String(s) => Ok(s),
            other => Err(err(
                key,
                format!("expected strings, found {}", other.type_str()),
            )),
        })
        .collect()
}
