//! Single byte-range requests (`Range: bytes=a-b`, `a-`, `-n`), resolved against a blob size.

/// An inclusive byte range inside a blob of known size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    pub start: u64,
    /// Inclusive, as in `Content-Range`.
    pub end: u64,
}

impl ByteRange {
    pub fn len(&self) -> u64 {
        self.end - self.start + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The `Content-Range` header value for this range of a blob of `size` bytes.
    pub fn content_range(&self, size: u64) -> String {
        format!("bytes {}-{}/{}", self.start, self.end, size)
    }
}

/// `(offset, length)` to read from a blob of `size` bytes, clamped so that a range for another
/// size reads short, never out of bounds.
pub fn span(range: Option<ByteRange>, size: u64) -> (u64, u64) {
    match range {
        Some(r) if r.start < size && r.start <= r.end => {
            (r.start, r.end.min(size - 1) - r.start + 1)
        }
        Some(_) => (size, 0),
        None => (0, size),
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RangeError {
    #[error("malformed Range header: {0}")]
    Malformed(&'static str),
    #[error("only a single byte range is supported")]
    MultipleRanges,
    /// Well formed, but no byte of it lies inside the blob: 416.
    #[error("range not satisfiable for a blob of {size} bytes")]
    Unsatisfiable { size: u64 },
}

/// Parses a `Range` header value against a blob of `size` bytes.
pub fn parse(header: &str, size: u64) -> Result<ByteRange, RangeError> {
    let spec = header
        .trim()
        .strip_prefix("bytes=")
        .ok_or(RangeError::Malformed("only the 'bytes' unit is supported"))?;
    if spec.contains(',') {
        return Err(RangeError::MultipleRanges);
    }
    let (first, last) = spec
        .trim()
        .split_once('-')
        .ok_or(RangeError::Malformed("expected 'first-last'"))?;
    let unsatisfiable = RangeError::Unsatisfiable { size };
    match (first.trim(), last.trim()) {
        ("", "") => Err(RangeError::Malformed("empty range")),
        ("", suffix) => {
            let n = number(suffix)?;
            if n == 0 || size == 0 {
                return Err(unsatisfiable);
            }
            Ok(ByteRange {
                start: size.saturating_sub(n),
                end: size - 1,
            })
        }
        (first, last) => {
            let start = number(first)?;
            let end = if last.is_empty() {
                None
            } else {
                Some(number(last)?)
            };
            if let Some(end) = end
                && end < start
            {
                return Err(RangeError::Malformed("last byte is before first byte"));
            }
            if start >= size {
                return Err(unsatisfiable);
            }
            let end = end.map_or(size - 1, |e| e.min(size - 1));
            Ok(ByteRange { start, end })
        }
    }
}

fn number(s: &str) -> Result<u64, RangeError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(RangeError::Malformed("positions must be decimal numbers"));
    }
    s.parse()
        .map_err(|_| RangeError::Malformed("position out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(start: u64, end: u64) -> Result<ByteRange, RangeError> {
        Ok(ByteRange { start, end })
    }

    #[test]
    fn the_three_forms() {
        assert_eq!(parse("bytes=0-9", 100), r(0, 9));
        assert_eq!(parse("bytes=90-", 100), r(90, 99));
        assert_eq!(parse("bytes=-10", 100), r(90, 99));
        assert_eq!(parse("bytes=5-5", 100), r(5, 5));
    }

    #[test]
    fn clamps_to_the_blob() {
        assert_eq!(parse("bytes=90-1000", 100), r(90, 99));
        assert_eq!(parse("bytes=-1000", 100), r(0, 99));
        assert_eq!(parse("bytes=0-", 1), r(0, 0));
    }

    #[test]
    fn unsatisfiable() {
        let u = Err(RangeError::Unsatisfiable { size: 100 });
        assert_eq!(parse("bytes=100-", 100), u);
        assert_eq!(parse("bytes=100-200", 100), u);
        assert_eq!(parse("bytes=-0", 100), u);
        assert_eq!(
            parse("bytes=0-0", 0),
            Err(RangeError::Unsatisfiable { size: 0 })
        );
        assert_eq!(
            parse("bytes=-5", 0),
            Err(RangeError::Unsatisfiable { size: 0 })
        );
    }

    #[test]
    fn malformed() {
        for bad in [
            "",
            "bytes",
            "bytes=",
            "bytes=-",
            "items=0-1",
            "bytes=a-b",
            "bytes=1-0",
            "bytes=+1-2",
            "bytes=0x10-",
            "bytes=99999999999999999999999-",
        ] {
            assert!(
                matches!(parse(bad, 100), Err(RangeError::Malformed(_))),
                "{bad:?}"
            );
        }
        assert_eq!(parse("bytes=0-1,5-6", 100), Err(RangeError::MultipleRanges));
    }

    #[test]
    fn spans_are_clamped() {
        assert_eq!(span(None, 10), (0, 10));
        assert_eq!(span(Some(ByteRange { start: 2, end: 4 }), 10), (2, 3));
        assert_eq!(span(Some(ByteRange { start: 8, end: 40 }), 10), (8, 2));
        assert_eq!(span(Some(ByteRange { start: 10, end: 12 }), 10), (10, 0));
        assert_eq!(span(Some(ByteRange { start: 0, end: 0 }), 0), (0, 0));
    }

    #[test]
    fn content_range_and_len() {
        let br = parse("bytes=10-19", 100).unwrap();
        assert_eq!(br.len(), 10);
        assert_eq!(br.content_range(100), "bytes 10-19/100");
    }
}
