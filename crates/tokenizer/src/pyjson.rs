//! JSON exactly as Python's `json` module reads and writes it.
//!
//! The reference encoder runs `json.loads` on tool-call arguments and writes values back
//! with `json.dumps(value, ensure_ascii=False)`. To reproduce its bytes we need Python's
//! number model (integers of any size kept exact, floats printed with `repr`), its
//! dictionaries (a repeated key keeps its first position and its last value), and its
//! accepted syntax (`NaN`, `Infinity`, `-Infinity`; no control characters in strings).
//! serde_json would lose big integers and float spellings, hence this small module.

use serde_json::Value;

/// A value as Python's `json.loads` would build it.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    Null,
    Bool(bool),
    /// Decimal digits with an optional leading `-`, canonical (`-0` is `0`).
    Int(String),
    Float(f64),
    Str(String),
    List(Vec<PyValue>),
    /// Insertion-ordered; keys are unique.
    Dict(Vec<(String, PyValue)>),
}

/// Nesting beyond this is treated as invalid JSON. Python gives up near its recursion
/// limit (about 1,000 frames) with a RecursionError, which the encoder treats like any
/// other failed `json.loads`; a fixed limit also keeps this parser's stack bounded.
const MAX_DEPTH: usize = 512;

/// Parses `text` like `json.loads`. Returns None where Python would raise.
pub fn loads(text: &str) -> Option<PyValue> {
    let mut p = Parser {
        s: text.as_bytes(),
        src: text,
        i: 0,
    };
    p.ws();
    let v = p.value(0)?;
    p.ws();
    (p.i == p.s.len()).then_some(v)
}

struct Parser<'a> {
    s: &'a [u8],
    src: &'a str,
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.s[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Option<PyValue> {
        if depth > MAX_DEPTH {
            return None;
        }
        match *self.s.get(self.i)? {
            b'"' => self.string().map(PyValue::Str),
            b'{' => self.dict(depth),
            b'[' => self.list(depth),
            b'n' if self.eat("null") => Some(PyValue::Null),
            b't' if self.eat("true") => Some(PyValue::Bool(true)),
            b'f' if self.eat("false") => Some(PyValue::Bool(false)),
            b'N' if self.eat("NaN") => Some(PyValue::Float(f64::NAN)),
            b'I' if self.eat("Infinity") => Some(PyValue::Float(f64::INFINITY)),
            b'-' if self.eat("-Infinity") => Some(PyValue::Float(f64::NEG_INFINITY)),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
            self.i += 1;
        }
        self.i - start
    }

    /// `-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?`, taking the optional parts only when whole.
    fn number(&mut self) -> Option<PyValue> {
        let start = self.i;
        if self.s[self.i] == b'-' {
            self.i += 1;
        }
        let int_start = self.i;
        match self.s.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return None,
        }
        let int_end = self.i;
        let mut is_float = false;
        if self.s.get(self.i) == Some(&b'.') {
            let save = self.i;
            self.i += 1;
            if self.digits() == 0 {
                self.i = save;
            } else {
                is_float = true;
            }
        }
        if matches!(self.s.get(self.i), Some(b'e' | b'E')) {
            let save = self.i;
            self.i += 1;
            if matches!(self.s.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                self.i = save;
            } else {
                is_float = true;
            }
        }
        let text = &self.src[start..self.i];
        if is_float {
            // Rust's parser is correctly rounded like Python's float(); overflow gives inf.
            text.parse::<f64>().ok().map(PyValue::Float)
        } else {
            let digits = &self.src[int_start..int_end];
            let neg = start != int_start && digits != "0";
            Some(PyValue::Int(if neg {
                format!("-{digits}")
            } else {
                digits.to_string()
            }))
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let h = self.s.get(self.i..self.i + 4)?;
        let h = std::str::from_utf8(h).ok()?;
        if !h.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        self.i += 4;
        u32::from_str_radix(h, 16).ok()
    }

    fn string(&mut self) -> Option<String> {
        self.i += 1;
        let mut out = String::new();
        loop {
            let start = self.i;
            while self.i < self.s.len() && !matches!(self.s[self.i], b'"' | b'\\' | 0..=0x1F) {
                self.i += 1;
            }
            out.push_str(&self.src[start..self.i]);
            match *self.s.get(self.i)? {
                b'"' => {
                    self.i += 1;
                    return Some(out);
                }
                b'\\' => {
                    self.i += 1;
                    let e = *self.s.get(self.i)?;
                    self.i += 1;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let u = self.hex4()?;
                            let cp = if (0xD800..0xDC00).contains(&u)
                                && self.s[self.i..].starts_with(b"\\u")
                            {
                                let save = self.i;
                                self.i += 2;
                                match self.hex4() {
                                    Some(lo) if (0xDC00..0xE000).contains(&lo) => {
                                        0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00)
                                    }
                                    _ => {
                                        self.i = save;
                                        u
                                    }
                                }
                            } else {
                                u
                            };
                            // Python keeps a lone surrogate; a Rust string cannot hold one.
                            out.push(char::from_u32(cp).unwrap_or('\u{FFFD}'));
                        }
                        _ => return None,
                    }
                }
                // A raw control character: json.loads is strict by default.
                _ => return None,
            }
        }
    }

    fn list(&mut self, depth: usize) -> Option<PyValue> {
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.eat("]") {
            return Some(PyValue::List(items));
        }
        loop {
            self.ws();
            items.push(self.value(depth + 1)?);
            self.ws();
            if self.eat(",") {
                continue;
            }
            if self.eat("]") {
                return Some(PyValue::List(items));
            }
            return None;
        }
    }

    fn dict(&mut self, depth: usize) -> Option<PyValue> {
        self.i += 1;
        let mut items: Vec<(String, PyValue)> = Vec::new();
        self.ws();
        if self.eat("}") {
            return Some(PyValue::Dict(items));
        }
        loop {
            self.ws();
            if self.s.get(self.i) != Some(&b'"') {
                return None;
            }
            let k = self.string()?;
            self.ws();
            if !self.eat(":") {
                return None;
            }
            self.ws();
            let v = self.value(depth + 1)?;
            match items.iter_mut().find(|(key, _)| *key == k) {
                Some(slot) => slot.1 = v,
                None => items.push((k, v)),
            }
            self.ws();
            if self.eat(",") {
                continue;
            }
            if self.eat("}") {
                return Some(PyValue::Dict(items));
            }
            return None;
        }
    }
}

/// Python's `repr(float)` as `json.dumps` writes it (`NaN`, `Infinity` for the others).
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // `{:e}` gives the shortest round-trip digits, as Python's repr does.
    let sci = format!("{:e}", f.abs());
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let n = digits.len() as i32;
    let decpt = exp + 1;
    let mut out = String::new();
    if f.is_sign_negative() {
        out.push('-');
    }
    if decpt <= -4 || decpt > 16 {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let e = decpt - 1;
        out.push_str(&format!("e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs()));
    } else if decpt <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-decpt) as usize));
        out.push_str(&digits);
    } else if decpt >= n {
        out.push_str(&digits);
        out.extend(std::iter::repeat_n('0', (decpt - n) as usize));
        out.push_str(".0");
    } else {
        out.push_str(&digits[..decpt as usize]);
        out.push('.');
        out.push_str(&digits[decpt as usize..]);
    }
    out
}

/// A JSON string literal as `json.dumps(s, ensure_ascii=False)` writes it.
pub fn write_str(out: &mut String, s: &str) {
    out.push('"');
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        let esc: Option<&str> = match b {
            b'"' => Some("\\\""),
            b'\\' => Some("\\\\"),
            b'\n' => Some("\\n"),
            b'\r' => Some("\\r"),
            b'\t' => Some("\\t"),
            0x08 => Some("\\b"),
            0x0C => Some("\\f"),
            0..=0x1F => None,
            _ => continue,
        };
        out.push_str(&s[start..i]);
        match esc {
            Some(e) => out.push_str(e),
            None => out.push_str(&format!("\\u{b:04x}")),
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

pub fn dumps_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    write_str(&mut out, s);
    out
}

impl PyValue {
    /// `json.dumps(self, ensure_ascii=False)`.
    pub fn dumps(&self) -> String {
        let mut out = String::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut String) {
        match self {
            PyValue::Null => out.push_str("null"),
            PyValue::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            PyValue::Int(d) => out.push_str(d),
            PyValue::Float(f) => out.push_str(&float_repr(*f)),
            PyValue::Str(s) => write_str(out, s),
            PyValue::List(items) => {
                out.push('[');
                for (k, v) in items.iter().enumerate() {
                    if k > 0 {
                        out.push_str(", ");
                    }
                    v.write(out);
                }
                out.push(']');
            }
            PyValue::Dict(items) => {
                out.push('{');
                for (k, (key, v)) in items.iter().enumerate() {
                    if k > 0 {
                        out.push_str(", ");
                    }
                    write_str(out, key);
                    out.push_str(": ");
                    v.write(out);
                }
                out.push('}');
            }
        }
    }

    /// Converts a serde_json value (already parsed, so big integers may have become floats).
    pub fn from_serde(v: &Value) -> PyValue {
        match v {
            Value::Null => PyValue::Null,
            Value::Bool(b) => PyValue::Bool(*b),
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    PyValue::Int(i.to_string())
                } else if let Some(u) = n.as_u64() {
                    PyValue::Int(u.to_string())
                } else {
                    PyValue::Float(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            Value::String(s) => PyValue::Str(s.clone()),
            Value::Array(a) => PyValue::List(a.iter().map(PyValue::from_serde).collect()),
            Value::Object(o) => PyValue::Dict(
                o.iter()
                    .map(|(k, v)| (k.clone(), PyValue::from_serde(v)))
                    .collect(),
            ),
        }
    }

    /// Python truthiness (`if value:`).
    pub fn truthy(&self) -> bool {
        match self {
            PyValue::Null => false,
            PyValue::Bool(b) => *b,
            PyValue::Int(d) => d != "0",
            PyValue::Float(f) => *f != 0.0,
            PyValue::Str(s) => !s.is_empty(),
            PyValue::List(l) => !l.is_empty(),
            PyValue::Dict(d) => !d.is_empty(),
        }
    }
}

/// `json.dumps(v, ensure_ascii=False)` of a serde_json value.
pub fn dumps_serde(v: &Value) -> String {
    PyValue::from_serde(v).dumps()
}

/// Python truthiness of a serde_json value.
pub fn serde_truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1e5, "100000.0"),
            (1e-7, "1e-07"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.1, "1.1"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (123.456, "123.456"),
            (1.5e300, "1.5e+300"),
            (5e-324, "5e-324"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (12345678901234567.0, "1.2345678901234568e+16"),
            (f64::INFINITY, "Infinity"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn loads_like_python() {
        let d = |s: &str| loads(s).map(|v| v.dumps());
        assert_eq!(
            d(r#"{"a": 1, "b": 2, "a": 3}"#).unwrap(),
            r#"{"a": 3, "b": 2}"#
        );
        assert_eq!(d("-0").unwrap(), "0");
        assert_eq!(d("-0.0").unwrap(), "-0.0");
        assert_eq!(d("1E-7").unwrap(), "1e-07");
        assert_eq!(
            d("123456789012345678901234567890").unwrap(),
            "123456789012345678901234567890"
        );
        assert_eq!(d(r#""\u00e9\ud83d\ude00""#).unwrap(), "\"é😀\"");
        assert_eq!(d("[NaN, -Infinity]").unwrap(), "[NaN, -Infinity]");
        assert_eq!(d(" {\"k\" : [1 , {}]} ").unwrap(), r#"{"k": [1, {}]}"#);
        for bad in [
            "", "01", "1.", "-", "{\"a\"}", "\"\t\"", "[1,]", "tru", "{} x", "\"\\x\"",
        ] {
            assert!(loads(bad).is_none(), "{bad:?}");
        }
        let deep = "[".repeat(100_000);
        assert!(loads(&deep).is_none());
    }

    #[test]
    fn dumps_escapes() {
        assert_eq!(
            dumps_str("a\"b\\c\n\u{1}\u{7f}é"),
            "\"a\\\"b\\\\c\\n\\u0001\u{7f}é\""
        );
    }
}
