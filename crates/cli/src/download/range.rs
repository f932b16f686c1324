//! The `Content-Range` header, which says where a resumed response starts and how long
//! the whole file is.

/// A parsed `Content-Range` response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentRange {
    /// `bytes FIRST-LAST/TOTAL` (TOTAL is `None` when the server sent `*`).
    Bytes {
        first: u64,
        last: u64,
        total: Option<u64>,
    },
    /// `bytes */TOTAL`, sent with 416 to say how long the resource really is.
    Unsatisfied { total: u64 },
}

/// Parses `Content-Range` (RFC 9110 §14.4); `None` for anything malformed.
pub fn parse_content_range(value: &str) -> Option<ContentRange> {
    let rest = value.trim().strip_prefix("bytes")?.trim_start();
    let (range, total) = rest.split_once('/')?;
    let total = total.trim();
    if range.trim() == "*" {
        return Some(ContentRange::Unsatisfied {
            total: total.parse().ok()?,
        });
    }
    let (first, last) = range.trim().split_once('-')?;
    let (first, last): (u64, u64) = (first.parse().ok()?, last.parse().ok()?);
    if last < first {
        return None;
    }
    let total = if total == "*" {
        None
    } else {
        let t: u64 = total.parse().ok()?;
        if last >= t {
            return None;
        }
        Some(t)
    };
    Some(ContentRange::Bytes { first, last, total })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range() {
        assert_eq!(
            parse_content_range("bytes 100-199/200"),
            Some(ContentRange::Bytes {
                first: 100,
                last: 199,
                total: Some(200)
            })
        );
        assert_eq!(
            parse_content_range("bytes 0-9/*"),
            Some(ContentRange::Bytes {
                first: 0,
                last: 9,
                total: None
            })
        );
        assert_eq!(
            parse_content_range("bytes */86720111488"),
            Some(ContentRange::Unsatisfied { total: 86720111488 })
        );
        for bad in [
            "",
            "bytes",
            "bytes 5-4/10",
            "bytes 0-10/10",
            "items 0-1/2",
            "bytes */*",
        ] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
    }
}
