//! A number written to one decimal, as `{:.1}` writes it, in integer
//! arithmetic: the decision header carries five such numbers per request,
//! and float formatting costs about ten times as much in the filter's wasm.

use std::fmt;

/// Writes `self.0` rounded to tenths (half away from zero; `{:.1}` rounds
/// exact ties to even, so the two differ only on exact ties).
pub struct Tenths(pub f64);

/// Beyond this the integer path could overflow; such costs are written as
/// `{:.1}` writes them.
const INTEGER_LIMIT: f64 = 1e15;

impl fmt::Display for Tenths {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scaled = (self.0 * 10.0).round();
        if !scaled.is_finite() || scaled.abs() >= INTEGER_LIMIT {
            return write!(f, "{:.1}", self.0);
        }
        let tenths = scaled as i64;
        let sign = if tenths < 0 { "-" } else { "" };
        let tenths = tenths.unsigned_abs();
        write!(f, "{sign}{}.{}", tenths / 10, tenths % 10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                assert_eq!(Tenths(x).to_string(), expected, "{x}");
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
            assert_eq!(Tenths(x).to_string(), format!("{x:.1}"));
        }
        assert_eq!(Tenths(1e14 + 0.04).to_string(), "100000000000000.0");
        assert_eq!(Tenths(-0.04).to_string(), "0.0");
        assert_eq!(Tenths(0.96).to_string(), "1.0");
        assert_eq!(Tenths(-1.26).to_string(), "-1.3");
    }
}
