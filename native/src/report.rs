//! Collects problems; each is one line naming the file/field and what was expected.

#[derive(Debug, Default)]
pub struct Problems {
    lines: Vec<String>,
}

impl Problems {
    pub fn push(&mut self, line: impl Into<String>) {
        // One line per problem, whatever the message carries.
        self.lines.push(line.into().replace('\n', " "));
    }

    /// Records `Err` as a problem prefixed with `context`; returns the `Ok` value.
    pub fn check<T>(&mut self, context: &str, result: Result<T, String>) -> Option<T> {
        match result {
            Ok(v) => Some(v),
            Err(e) => {
                self.push(format!("{context}: {e}"));
                None
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    pub fn lines(&self) -> &[String] {
        &self.lines
    }
}
