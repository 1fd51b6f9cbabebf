//! Half-precision element types: [`F16`] (IEEE 754 binary16, `HPS_DTYPE_FLOAT16`) and
//! [`BF16`] (bfloat16, `HPS_DTYPE_BFLOAT16`), each a `#[repr(transparent)]` newtype over
//! its `u16` bit pattern, with conversions to and from `f32` written here with std only.
//!
//! The conversion rules are documented on [`F16`].

use std::fmt;

/// An IEEE half-precision (binary16) value by its bits (`HPS_DTYPE_FLOAT16`): 1 sign
/// bit, 5 exponent bits, 10 mantissa bits; largest finite value 65504.
///
/// Hands `u16` storage to collectives and clips with an explicit dtype (see
/// [`F16::from_bits_slice_mut`]), and is the element of the engine's float16 views
/// ([`crate::Engine::param_f16`]). [`F16::from_f32`] / [`F16::to_f32`] convert as the
/// library does.
///
/// # Conversions (`F16` and [`BF16`])
///
/// The conversions are those of the C++ core (`core/common/half.h`), bit for bit, so
/// that a value rounded here is the value the library would round (the engine rounds
/// the reduced gradients and the parameters with them; collectives round the fp32
/// sums):
///
/// * `to_f32` is exact: every binary16 / bfloat16 value is an `f32`. Infinities stay
///   infinite, subnormals are exact, a NaN stays a NaN with its sign and its payload
///   (widened into the top bits of the `f32` mantissa).
/// * `from_f32` rounds to nearest, ties to even, also into and within the subnormal
///   range; values whose magnitude rounds past the largest finite value (`F16`: from
///   65520 = 65504 + half an ulp on; `BF16`: from 2^128 − 2^119 on) become ±infinity,
///   and ±infinity stays ±infinity. A NaN becomes a *quiet* NaN with the same sign and
///   the top payload bits (`F16`: `0x7e00 | payload >> 13`; `BF16`: `bits >> 16 |
///   0x0040`).
///
/// So `from_f32(x.to_f32()) == x` for every bit pattern except the signalling NaNs,
/// which come back quiet (the quiet bit, `0x0200` for `F16`, `0x0040` for `BF16`, set;
/// sign and the other payload bits kept).
///
/// `PartialEq` / `Eq` / `Hash` compare the bit patterns: `+0 != -0` and a NaN equals
/// itself. Compare `to_f32()` values for IEEE equality.
///
/// ```
/// use hpshard::{BF16, F16};
/// assert_eq!(F16::from_f32(1.0), F16::ONE);
/// assert_eq!(F16::from_f32(65504.0).to_bits(), 0x7bff);
/// assert_eq!(F16::from_f32(65520.0), F16::INFINITY);
/// assert_eq!(F16::from_bits(0x0001).to_f32(), 2f32.powi(-24));
/// assert_eq!(BF16::from_f32(1.00390625).to_f32(), 1.0); // a tie, to even
/// assert_eq!(BF16::from_f32(1.01171875).to_f32(), 1.015625); // a tie, to even (up)
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F16(pub u16);

/// A bfloat16 value by its bits (`HPS_DTYPE_BFLOAT16`): the top 16 bits of an `f32`
/// (1 sign bit, 8 exponent bits, 7 mantissa bits); the element of the engine's
/// bfloat16 views ([`crate::Engine::param_bf16`]). [`BF16::from_f32`] /
/// [`BF16::to_f32`] convert as the library does (see [`F16`], "Conversions"); equality
/// is bitwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct BF16(pub u16);

macro_rules! half_common {
    ($t:ident, $exp_mask:expr, $man_mask:expr) => {
        impl $t {
            /// The value with these bits.
            pub const fn from_bits(bits: u16) -> $t {
                $t(bits)
            }

            /// The bits.
            pub const fn to_bits(self) -> u16 {
                self.0
            }

            /// Whether this is a NaN (any payload, either sign).
            pub const fn is_nan(self) -> bool {
                self.0 & $exp_mask == $exp_mask && self.0 & $man_mask != 0
            }

            /// Whether this is +infinity or -infinity.
            pub const fn is_infinite(self) -> bool {
                self.0 & 0x7fff == $exp_mask
            }

            /// Whether this is neither infinite nor NaN.
            pub const fn is_finite(self) -> bool {
                self.0 & $exp_mask != $exp_mask
            }

            /// Whether the sign bit is set (also for -0 and NaNs).
            pub const fn is_sign_negative(self) -> bool {
                self.0 & 0x8000 != 0
            }

            /// View `u16` bits as this type (same layout, `#[repr(transparent)]`).
            pub fn from_bits_slice(bits: &[u16]) -> &[$t] {
                // SAFETY: $t is #[repr(transparent)] over u16: same size, alignment and
                // validity; the lifetime is carried over.
                unsafe { std::slice::from_raw_parts(bits.as_ptr().cast(), bits.len()) }
            }

            /// View mutable `u16` bits as this type.
            pub fn from_bits_slice_mut(bits: &mut [u16]) -> &mut [$t] {
                // SAFETY: as from_bits_slice; the unique borrow is carried over.
                unsafe { std::slice::from_raw_parts_mut(bits.as_mut_ptr().cast(), bits.len()) }
            }

            /// View these values as their `u16` bits.
            pub fn to_bits_slice(values: &[$t]) -> &[u16] {
                // SAFETY: as from_bits_slice, the other way round.
                unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), values.len()) }
            }

            /// View mutable values as their `u16` bits.
            pub fn to_bits_slice_mut(values: &mut [$t]) -> &mut [u16] {
                // SAFETY: as from_bits_slice_mut, the other way round.
                unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len()) }
            }
        }

        impl From<$t> for f32 {
            /// Exact (`to_f32`).
            fn from(value: $t) -> f32 {
                value.to_f32()
            }
        }

        impl From<$t> for f64 {
            /// Exact.
            fn from(value: $t) -> f64 {
                f64::from(value.to_f32())
            }
        }

        impl fmt::Display for $t {
            /// The `f32` value (`to_f32`), formatted as `f32` formats it.
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.to_f32(), f)
            }
        }
    };
}

half_common!(F16, 0x7c00u16, 0x03ffu16);
half_common!(BF16, 0x7f80u16, 0x007fu16);

impl F16 {
    /// +0.
    pub const ZERO: F16 = F16(0x0000);
    /// -0.
    pub const NEG_ZERO: F16 = F16(0x8000);
    /// 1.
    pub const ONE: F16 = F16(0x3c00);
    /// +infinity.
    pub const INFINITY: F16 = F16(0x7c00);
    /// -infinity.
    pub const NEG_INFINITY: F16 = F16(0xfc00);
    /// The quiet NaN `0x7e00` (what `from_f32(f32::NAN)` gives).
    pub const NAN: F16 = F16(0x7e00);
    /// The largest finite value, 65504.
    pub const MAX: F16 = F16(0x7bff);
    /// The smallest finite value, -65504.
    pub const MIN: F16 = F16(0xfbff);
    /// The smallest positive normal value, 2^-14.
    pub const MIN_POSITIVE: F16 = F16(0x0400);
    /// The smallest positive subnormal value, 2^-24.
    pub const MIN_POSITIVE_SUBNORMAL: F16 = F16(0x0001);
    /// The difference between 1 and the next larger value, 2^-10.
    pub const EPSILON: F16 = F16(0x1400);

    /// The nearest binary16 value to `value`, ties to even (`float_to_half_bits` of the
    /// C++ core, bit for bit): magnitudes from 65520 on (and infinities) give
    /// infinity of the same sign, magnitudes below 2^-14 round to a subnormal or zero,
    /// a NaN gives the quiet NaN `sign | 0x7e00 | payload >> 13`.
    pub fn from_f32(value: f32) -> F16 {
        let x = value.to_bits();
        let sign = ((x >> 16) & 0x8000) as u16;
        let magnitude = x & 0x7fff_ffff;
        if magnitude > 0x7f80_0000 {
            // NaN: quiet it, keep the sign and the top payload bits.
            return F16(sign | 0x7e00 | ((magnitude >> 13) & 0x3ff) as u16);
        }
        if magnitude >= 0x477f_f000 {
            // >= 65520 (half an ulp past 65504; the tie goes to the even infinity) and
            // infinity.
            return F16(sign | 0x7c00);
        }
        if magnitude < 0x3880_0000 {
            // Below 2^-14: a subnormal (or zero), in units of 2^-24, rounded to nearest
            // even. The core adds 0.5f and lets the FPU round; the same rounding on
            // integers here, independent of the floating-point environment.
            let exponent = magnitude >> 23; // biased; < 113 here
            if exponent == 0 {
                // An f32 subnormal, below 2^-126: far below half of 2^-24.
                return F16(sign);
            }
            let significand = (magnitude & 0x007f_ffff) | 0x0080_0000; // value = s * 2^(e-150)
            let shift = 126 - exponent; // value / 2^-24 = s / 2^shift; shift >= 14
            if shift > 24 {
                // Below 2^-25 = half the smallest subnormal: zero.
                return F16(sign);
            }
            let quotient = significand >> shift;
            let remainder = significand & ((1u32 << shift) - 1);
            let half = 1u32 << (shift - 1);
            let rounded = if remainder > half || (remainder == half && quotient & 1 == 1) {
                quotient + 1
            } else {
                quotient
            };
            // rounded <= 0x400: 2^-14 (the smallest normal) when it rounds up to it.
            return F16(sign | rounded as u16);
        }
        // Normal: rebias the exponent (127 -> 15) and round half to even on the 13 bits
        // dropped; a carry out of the mantissa bumps the exponent (up to 0x7bff + 1 =
        // infinity is excluded above).
        let odd = (magnitude >> 13) & 1;
        let rounded = magnitude.wrapping_add(0xc800_0fff + odd);
        F16(sign | (rounded >> 13) as u16)
    }

    /// The exact `f32` value (`half_bits_to_float` of the C++ core): a NaN keeps its
    /// sign and payload (shifted into the top of the `f32` mantissa).
    pub fn to_f32(self) -> f32 {
        let h = u32::from(self.0);
        let sign = (h & 0x8000) << 16;
        let exponent = (h >> 10) & 0x1f;
        let mantissa = h & 0x3ff;
        if exponent == 0x1f {
            // Infinity or NaN: widen the payload.
            return f32::from_bits(sign | 0x7f80_0000 | (mantissa << 13));
        }
        if exponent == 0 {
            if mantissa == 0 {
                return f32::from_bits(sign);
            }
            // Subnormal: mantissa * 2^-24, normalised (exact in f32).
            let shift = mantissa.leading_zeros() - 21; // moves the top set bit to bit 10
            let normalised = (mantissa << shift) & 0x3ff;
            let f32_exponent = 113 - shift; // 2^(-14 - shift), biased by 127
            return f32::from_bits(sign | (f32_exponent << 23) | (normalised << 13));
        }
        f32::from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13))
    }
}

impl BF16 {
    /// +0.
    pub const ZERO: BF16 = BF16(0x0000);
    /// -0.
    pub const NEG_ZERO: BF16 = BF16(0x8000);
    /// 1.
    pub const ONE: BF16 = BF16(0x3f80);
    /// +infinity.
    pub const INFINITY: BF16 = BF16(0x7f80);
    /// -infinity.
    pub const NEG_INFINITY: BF16 = BF16(0xff80);
    /// The quiet NaN `0x7fc0` (what `from_f32(f32::NAN)` gives).
    pub const NAN: BF16 = BF16(0x7fc0);
    /// The largest finite value, (2 - 2^-7) * 2^127.
    pub const MAX: BF16 = BF16(0x7f7f);
    /// The smallest finite value, -(2 - 2^-7) * 2^127.
    pub const MIN: BF16 = BF16(0xff7f);
    /// The smallest positive normal value, 2^-126.
    pub const MIN_POSITIVE: BF16 = BF16(0x0080);
    /// The smallest positive subnormal value, 2^-133.
    pub const MIN_POSITIVE_SUBNORMAL: BF16 = BF16(0x0001);
    /// The difference between 1 and the next larger value, 2^-7.
    pub const EPSILON: BF16 = BF16(0x3c00);

    /// The nearest bfloat16 value to `value`, ties to even (`float_to_bf16_bits` of the
    /// C++ core, bit for bit): the top 16 bits of the `f32`, rounded on the 16 dropped
    /// ones (subnormals included; a carry past the largest finite value gives
    /// infinity); a NaN gives the quiet NaN `bits >> 16 | 0x0040`.
    pub fn from_f32(value: f32) -> BF16 {
        let x = value.to_bits();
        if x & 0x7fff_ffff > 0x7f80_0000 {
            // NaN: quiet it, keep the sign and the top payload bits.
            return BF16(((x >> 16) | 0x0040) as u16);
        }
        let lsb = (x >> 16) & 1;
        // No overflow: x <= 0xff80_0000 here.
        BF16(((x + 0x7fff + lsb) >> 16) as u16)
    }

    /// The exact `f32` value: the bits in the top half of an `f32`.
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}
