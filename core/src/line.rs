//! The decision header's line, written without `core::fmt` for its
//! numbers: the header is built for every routed request, and formatting
//! through `write!` cost the filter's wasm ~3 µs a line (float formatting
//! ten times more). Costs are written to one decimal, as `{:.1}` writes
//! them, in integer arithmetic.

use std::fmt::Write;

/// A line of text with integers and tenths appended in place.
#[derive(Debug, Default)]
pub struct Line(String);

/// Beyond this the integer path could overflow; such costs are written as
/// `{:.1}` writes them.
const INTEGER_LIMIT: f64 = 1e15;

impl Line {
    pub fn with_capacity(bytes: usize) -> Line {
        Line(String::with_capacity(bytes))
    }

    pub fn text(&mut self, text: &str) -> &mut Line {
        self.0.push_str(text);
        self
    }

    pub fn int(&mut self, n: impl itoa::Integer) -> &mut Line {
        self.0.push_str(itoa::Buffer::new().format(n));
        self
    }

    /// `x` rounded to tenths (half away from zero; `{:.1}` rounds exact
    /// ties to even, so the two differ only on exact ties).
    pub fn tenths(&mut self, x: f64) -> &mut Line {
        let scaled = (x * 10.0).round();
        if !scaled.is_finite() || scaled.abs() >= INTEGER_LIMIT {
            let _ = write!(self.0, "{x:.1}");
            return self;
        }
        let tenths = scaled as i64;
        if tenths < 0 {
            self.0.push('-');
        }
        let tenths = tenths.unsigned_abs();
        self.int(tenths / 10);
        self.0.push('.');
        self.int(tenths % 10)
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(x: f64) -> String {
        let mut line = Line::default();
        line.tenths(x);
        line.into_string()
    }

    #[test]
    fn writes_what_float_formatting_writes_away_from_ties() {
        let mut x: f64 = -5000.0;
        let mut compared = 0;
        while x < 5000.0 {
            // Skip exact and near ties (x.x5), where the rounding rules differ.
            let hundredths = (x * 100.0).rem_euclid(10.0);
            if (hundredths - 5.0).abs() > 1e-6 {
                // `{:.1}` keeps the sign of a value that rounds to zero.
                let expected = format!("{x:.1}").replace("-0.0", "0.0");
                assert_eq!(written(x), expected, "{x}");
                compared += 1;
            }
            x += 0.0137;
        }
        assert!(compared > 700_000, "{compared}");
    }

    #[test]
    fn writes_odd_and_huge_values_as_float_formatting_does() {
        for x in [
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            1e300,
            -2e17,
            f64::MAX,
        ] {
            assert_eq!(written(x), format!("{x:.1}"));
        }
        assert_eq!(written(1e14 + 0.04), "100000000000000.0");
        assert_eq!(written(-0.04), "0.0");
        assert_eq!(written(0.96), "1.0");
        assert_eq!(written(-1.26), "-1.3");
    }

    #[test]
    fn text_and_integers_append_in_order() {
        let mut line = Line::with_capacity(8);
        line.text("n=")
            .int(42u32)
            .text(" m=")
            .int(-7i64)
            .text(" c=")
            .tenths(2.25);
        assert_eq!(line.into_string(), "n=42 m=-7 c=2.3");
    }
}
