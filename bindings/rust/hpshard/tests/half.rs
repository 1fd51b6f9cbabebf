// F16 / BF16 conversions: all 65,536 bit patterns of each type, known values, an
// independent reference rounding (nearest candidate by distance, ties to even, from the
// formats' definitions in f64) over every tie and its neighbours and a sweep of f32
// inputs, and the library's own rounding (collectives over two thread-ranks add
// half-precision values in fp32 and round with core/common/half.h) bit for bit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hpshard::{Communicator, ReduceOp, BF16, F16};

const COMM_TIMEOUT: Duration = Duration::from_secs(20);
const RANKS_DEADLINE: Duration = Duration::from_secs(60);

mod common;

// ---------------------------------------------------------------------------------
// An independent reference
// ---------------------------------------------------------------------------------

/// The two formats, described by their fields only.
#[derive(Clone, Copy, Debug)]
struct Format {
    mantissa_bits: u32,
    exponent_bits: u32,
}

const BINARY16: Format = Format {
    mantissa_bits: 10,
    exponent_bits: 5,
};
const BFLOAT16: Format = Format {
    mantissa_bits: 7,
    exponent_bits: 8,
};

impl Format {
    fn bias(self) -> i32 {
        (1 << (self.exponent_bits - 1)) - 1
    }
    fn exponent_mask(self) -> u16 {
        (((1u32 << self.exponent_bits) - 1) << self.mantissa_bits) as u16
    }
    /// The positive pattern of +infinity (the first past the largest finite value).
    fn infinity(self) -> u16 {
        self.exponent_mask()
    }
    fn quiet_bit(self) -> u16 {
        1 << (self.mantissa_bits - 1)
    }
    /// The magnitude of a positive pattern up to and including `infinity()`, which
    /// stands for 2^(emax + 1), the value an unbounded exponent would give (IEEE 754
    /// rounds to it, then overflows to infinity).
    fn magnitude(self, bits: u16) -> f64 {
        let m = (bits as u32) & ((1 << self.mantissa_bits) - 1);
        let e = ((bits as u32) >> self.mantissa_bits) as i32;
        let scale = |k: i32| 2f64.powi(k);
        if e == 0 {
            m as f64 * scale(1 - self.bias() - self.mantissa_bits as i32)
        } else {
            (1.0 + m as f64 * scale(-(self.mantissa_bits as i32))) * scale(e - self.bias())
        }
    }
    /// The exact value of any non-NaN pattern.
    fn value(self, bits: u16) -> f64 {
        let magnitude = bits & 0x7fff;
        let v = if magnitude == self.infinity() {
            f64::INFINITY
        } else {
            self.magnitude(magnitude)
        };
        if bits & 0x8000 != 0 {
            -v
        } else {
            v
        }
    }
    fn is_nan(self, bits: u16) -> bool {
        bits & 0x7fff > self.infinity()
    }
    /// The nearest pattern to the non-NaN `x`: the candidates around |x| by distance,
    /// ties to the even pattern; rounding to 2^(emax + 1) is infinity.
    fn round(self, x: f32) -> u16 {
        assert!(!x.is_nan());
        let sign: u16 = if x.is_sign_negative() { 0x8000 } else { 0 };
        let a = x.abs() as f64;
        if a.is_infinite() {
            return sign | self.infinity();
        }
        if a >= self.magnitude(self.infinity()) {
            return sign | self.infinity();
        }
        // The largest k <= infinity() with magnitude(k) <= a (magnitude is increasing).
        let (mut lo, mut hi) = (0u16, self.infinity());
        while lo < hi {
            let mid = lo + (hi - lo + 1) / 2;
            if self.magnitude(mid) <= a {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let below = self.magnitude(lo);
        if below == a {
            return sign | lo;
        }
        let above = self.magnitude(lo + 1);
        let (d_below, d_above) = (a - below, above - a); // exact in f64
        let k = if d_below < d_above || (d_below == d_above && lo % 2 == 0) {
            lo
        } else {
            lo + 1
        };
        sign | k
    }
}

trait Half: Copy + PartialEq + std::fmt::Debug {
    const FORMAT: Format;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn bits(self) -> u16;
    fn of(bits: u16) -> Self;
}

impl Half for F16 {
    const FORMAT: Format = BINARY16;
    fn from_f32(x: f32) -> F16 {
        F16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        F16::to_f32(self)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn of(bits: u16) -> F16 {
        F16::from_bits(bits)
    }
}

impl Half for BF16 {
    const FORMAT: Format = BFLOAT16;
    fn from_f32(x: f32) -> BF16 {
        BF16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        BF16::to_f32(self)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn of(bits: u16) -> BF16 {
        BF16::from_bits(bits)
    }
}

/// The NaN `from_f32` makes of the f32 NaN `x`: quiet, sign and top payload kept.
fn expected_nan<H: Half>(x: f32) -> u16 {
    let bits = x.to_bits();
    let f = H::FORMAT;
    let sign = ((bits >> 16) & 0x8000) as u16;
    let payload = ((bits >> (23 - f.mantissa_bits)) & ((1 << f.mantissa_bits) - 1)) as u16;
    sign | f.infinity() | f.quiet_bit() | payload
}

fn check_from_f32<H: Half>(x: f32) {
    let got = H::from_f32(x).bits();
    let want = if x.is_nan() {
        expected_nan::<H>(x)
    } else {
        H::FORMAT.round(x)
    };
    assert_eq!(
        got,
        want,
        "{}::from_f32({:e} = {:#010x}): got {:#06x}, want {:#06x}",
        std::any::type_name::<H>(),
        x,
        x.to_bits(),
        got,
        want
    );
}

// ---------------------------------------------------------------------------------
// All patterns
// ---------------------------------------------------------------------------------

/// to_f32 is exact, and from_f32(to_f32(h)) == h for every pattern but the signalling
/// NaNs, which come back with the quiet bit set (sign and payload kept).
fn all_patterns<H: Half>() {
    let f = H::FORMAT;
    let mut signalling = 0;
    for bits in 0..=u16::MAX {
        let h = H::of(bits);
        let x = h.to_f32();
        let back = H::from_f32(x).bits();
        if f.is_nan(bits) {
            assert!(x.is_nan(), "{:#06x} -> {}", bits, x);
            assert_eq!(x.is_sign_negative(), bits & 0x8000 != 0, "{:#06x}", bits);
            assert_eq!(
                back,
                bits | f.quiet_bit(),
                "NaN {:#06x} comes back quiet",
                bits
            );
            if bits & f.quiet_bit() == 0 {
                signalling += 1;
            }
        } else {
            assert_eq!(x as f64, f.value(bits), "{:#06x} -> {:e}", bits, x);
            assert_eq!(
                x.is_sign_negative(),
                bits & 0x8000 != 0,
                "{:#06x}: the sign of zero",
                bits
            );
            assert_eq!(back, bits, "{:#06x} -> {:e} -> {:#06x}", bits, x, back);
        }
    }
    // 2 signs x (2^(m-1) - 1) signalling payloads.
    assert_eq!(signalling, 2 * ((1 << (f.mantissa_bits - 1)) - 1));
}

#[test]
fn f16_every_pattern_round_trips() {
    all_patterns::<F16>();
}

#[test]
fn bf16_every_pattern_round_trips() {
    all_patterns::<BF16>();
}

/// Every tie between two neighbouring patterns (positive and negative, the one past
/// the largest finite value included), exactly and one f32 ulp either side, and each
/// pattern's value one ulp either side.
fn ties_and_neighbours<H: Half>() {
    let f = H::FORMAT;
    let next_up = |x: f32| f32::from_bits(x.to_bits() + 1); // positive x
    let next_down = |x: f32| f32::from_bits(x.to_bits() - 1); // positive x > 0
    for bits in 0..f.infinity() {
        let lo = f.magnitude(bits);
        let hi = f.magnitude(bits + 1);
        let mid = ((lo + hi) / 2.0) as f32;
        assert_eq!(mid as f64, (lo + hi) / 2.0, "ties are f32 values");
        let value = lo as f32;
        let mut inputs = vec![mid, next_up(mid), next_down(mid), value, next_up(value)];
        if value > 0.0 {
            inputs.push(next_down(value));
        }
        for x in inputs {
            check_from_f32::<H>(x);
            check_from_f32::<H>(-x);
        }
    }
}

#[test]
fn f16_rounds_ties_to_even_like_the_reference() {
    ties_and_neighbours::<F16>();
}

#[test]
fn bf16_rounds_ties_to_even_like_the_reference() {
    ties_and_neighbours::<BF16>();
}

/// A sweep of f32 bit patterns (every 4099th, NaNs and infinities included).
fn sweep<H: Half>() {
    let mut bits: u64 = 0;
    while bits <= u32::MAX as u64 {
        check_from_f32::<H>(f32::from_bits(bits as u32));
        bits += 4099;
    }
    for x in [
        0.0f32,
        -0.0,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling, low payload
        f32::from_bits(0xffbf_ffff), // signalling, full payload, negative
    ] {
        check_from_f32::<H>(x);
    }
}

#[test]
fn f16_sweep_matches_the_reference() {
    sweep::<F16>();
}

#[test]
fn bf16_sweep_matches_the_reference() {
    sweep::<BF16>();
}

// ---------------------------------------------------------------------------------
// Known values
// ---------------------------------------------------------------------------------

#[test]
fn f16_known_values() {
    let two = |k: i32| 2f32.powi(k);
    let cases: [(f32, u16); 26] = [
        (1.0, 0x3c00),
        (-2.0, 0xc000),
        (0.5, 0x3800),
        (0.1, 0x2e66),
        (65504.0, 0x7bff),   // the largest finite value
        (65519.996, 0x7bff), // just below the tie with 65536
        (65520.0, 0x7c00),   // the tie: to even, which is infinity
        (-65520.0, 0xfc00),  //
        (1e10, 0x7c00),      // overflow
        (f32::MAX, 0x7c00),  //
        (two(-14), 0x0400),  // the smallest normal
        (two(-24), 0x0001),  // the smallest subnormal
        (two(-25), 0x0000),  // the tie with zero: to even, zero
        (two(-25) * 1.000_001, 0x0001),
        (-two(-25), 0x8000),            // -0
        (3.0 * two(-25), 0x0002),       // the tie between 1 and 2 ulps: to 2
        (5.0 * two(-25), 0x0002),       // between 2 and 3 ulps: to 2
        (two(-14) - two(-25), 0x0400),  // the tie between 0x3ff and 0x400: to 0x400
        (two(-14) - two(-24), 0x03ff),  // the largest subnormal
        (1.0 + two(-11), 0x3c00),       // tie: to even (down)
        (1.0 + 3.0 * two(-11), 0x3c02), // tie: to even (up)
        (f32::from_bits(1), 0x0000),    // an f32 subnormal
        (-0.0, 0x8000),
        (f32::INFINITY, 0x7c00),
        (f32::NEG_INFINITY, 0xfc00),
        (f32::NAN, 0x7e00),
    ];
    for &(x, bits) in cases.iter() {
        assert_eq!(F16::from_f32(x).to_bits(), bits, "F16::from_f32({:e})", x);
    }
    // A signalling NaN payload keeps its top bits and becomes quiet.
    assert_eq!(F16::from_f32(f32::from_bits(0x7fa0_0000)).to_bits(), 0x7f00);
    assert_eq!(F16::from_f32(f32::from_bits(0xff80_0001)).to_bits(), 0xfe00);
    assert_eq!(F16::from_bits(0x0001).to_f32(), two(-24));
    assert_eq!(F16::from_bits(0x03ff).to_f32(), two(-14) - two(-24));
    assert_eq!(F16::MAX.to_f32(), 65504.0);
    assert_eq!(F16::MIN.to_f32(), -65504.0);
    assert_eq!(F16::MIN_POSITIVE.to_f32(), two(-14));
    assert_eq!(F16::MIN_POSITIVE_SUBNORMAL.to_f32(), two(-24));
    assert_eq!(F16::EPSILON.to_f32(), two(-10));
    assert_eq!(F16::ONE.to_f32(), 1.0);
    assert_eq!(F16::NEG_ZERO.to_f32().to_bits(), 0x8000_0000);
    assert_eq!(F16::INFINITY.to_f32(), f32::INFINITY);
    assert_eq!(F16::NEG_INFINITY.to_f32(), f32::NEG_INFINITY);
    assert_eq!(F16::from_bits(0x7c01).to_f32().to_bits(), 0x7f80_2000); // payload widened
    assert!(F16::NAN.is_nan() && !F16::NAN.is_finite() && !F16::NAN.is_infinite());
    assert!(F16::INFINITY.is_infinite() && !F16::INFINITY.is_nan());
    assert!(F16::MAX.is_finite() && F16::NEG_ZERO.is_sign_negative());
    assert_eq!(F16::from_f32(f32::NAN), F16::NAN);
}

#[test]
fn bf16_known_values() {
    let cases: [(u32, u16); 16] = [
        (0x3f80_0000, 0x3f80), // 1
        (0x3f80_8000, 0x3f80), // 1.00390625: the tie, to even (down)
        (0x3f80_8001, 0x3f81), // just above the tie
        (0x3f81_8000, 0x3f82), // 1.01171875: the tie, to even (up)
        (0x3f81_7fff, 0x3f81), // just below the tie
        (0x4049_0fdb, 0x4049), // pi
        (0x7f7f_7fff, 0x7f7f), // below the tie with 2^128: the largest finite value
        (0x7f7f_8000, 0x7f80), // the tie: to even, which is infinity
        (0x7f7f_ffff, 0x7f80), // f32::MAX
        (0xff7f_ffff, 0xff80), // f32::MIN
        (0x0000_8000, 0x0000), // a subnormal tie: to even (zero)
        (0x0001_8000, 0x0002), // a subnormal tie: to even (up)
        (0x0000_0001, 0x0000), // the smallest f32 subnormal
        (0x0080_0000, 0x0080), // the smallest normal
        (0x7f80_0000, 0x7f80), // infinity
        (0x8000_0000, 0x8000), // -0
    ];
    for &(x, bits) in cases.iter() {
        assert_eq!(
            BF16::from_f32(f32::from_bits(x)).to_bits(),
            bits,
            "BF16::from_f32({:#010x})",
            x
        );
    }
    assert_eq!(BF16::from_f32(1.00390625).to_f32(), 1.0);
    assert_eq!(BF16::from_f32(1.01171875).to_f32(), 1.015625);
    // NaNs: quiet, sign and top payload kept; the low payload bits are lost.
    assert_eq!(BF16::from_f32(f32::NAN), BF16::NAN);
    assert_eq!(
        BF16::from_f32(f32::from_bits(0x7f80_0001)).to_bits(),
        0x7fc0
    );
    assert_eq!(
        BF16::from_f32(f32::from_bits(0xff81_0000)).to_bits(),
        0xffc1
    );
    assert_eq!(BF16::from_bits(0x7f81).to_f32().to_bits(), 0x7f81_0000);
    assert_eq!(BF16::MAX.to_f32(), f32::from_bits(0x7f7f_0000));
    assert_eq!(BF16::MIN_POSITIVE.to_f32(), f32::MIN_POSITIVE);
    assert_eq!(
        BF16::MIN_POSITIVE_SUBNORMAL.to_f32(),
        f32::from_bits(0x0001_0000)
    ); // 2^-133
    assert_eq!(BF16::EPSILON.to_f32(), 2f32.powi(-7));
    assert_eq!(BF16::ONE.to_f32(), 1.0);
    assert!(BF16::NAN.is_nan() && BF16::NEG_INFINITY.is_infinite());
}

#[test]
fn traits_and_slices() {
    assert_eq!(F16::default(), F16::ZERO);
    assert_eq!(BF16::default(), BF16::ZERO);
    // Equality is bitwise.
    assert_ne!(F16::ZERO, F16::NEG_ZERO);
    assert_eq!(F16::NAN, F16::NAN);
    assert_eq!(f32::from(F16::ONE), 1.0);
    assert_eq!(f64::from(BF16::from_bits(0x4040)), 3.0);
    assert_eq!(format!("{}", F16::from_f32(1.5)), "1.5");
    assert_eq!(format!("{}", BF16::NEG_INFINITY), "-inf");
    assert_eq!(format!("{:?}", F16::ONE), "F16(15360)");
    assert_eq!(std::mem::size_of::<F16>(), 2);
    assert_eq!(std::mem::align_of::<BF16>(), 2);
    let mut bits = [0x3c00u16, 0x4000];
    assert_eq!(F16::from_bits_slice(&bits), &[F16::ONE, F16(0x4000)]);
    F16::from_bits_slice_mut(&mut bits)[1] = F16::from_f32(-1.0);
    assert_eq!(bits, [0x3c00, 0xbc00]);
    let mut values = [BF16::ONE, BF16::ZERO];
    assert_eq!(BF16::to_bits_slice(&values), &[0x3f80, 0]);
    BF16::to_bits_slice_mut(&mut values)[1] = 0x4000;
    assert_eq!(values[1].to_f32(), 2.0);
}

// ---------------------------------------------------------------------------------
// The library's rounding, bit for bit
// ---------------------------------------------------------------------------------

fn unique_url(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "memory://rust-half-{}-{}-{}",
        tag,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

/// Every non-NaN pattern (NaNs are replaced by 0: which NaN an fp32 sum of two NaNs
/// gives is the hardware's business), and a second operand per element.
fn operands<H: Half>() -> (Vec<H>, Vec<H>) {
    let clean = |bits: u16| {
        if H::FORMAT.is_nan(bits) {
            H::of(0)
        } else {
            H::of(bits)
        }
    };
    let a: Vec<H> = (0..=u16::MAX).map(clean).collect();
    // A scrambled pattern; for odd elements with the sign and exponent of the first
    // operand, so that the sum needs one bit more than the type has (a tie whenever
    // that bit is set, and overflow at the top); for even ones anything, so that the
    // fp32 sums land on all sorts of roundings.
    let sign_and_exponent = 0x8000 | H::FORMAT.exponent_mask();
    let b: Vec<H> = (0..=u16::MAX)
        .map(|i| {
            let scrambled = (i as u32).wrapping_mul(40503).wrapping_add(12345) as u16;
            if i % 2 == 0 {
                clean(scrambled)
            } else {
                clean((i & sign_and_exponent) | (scrambled & !sign_and_exponent))
            }
        })
        .collect();
    (a, b)
}

/// Two thread-ranks all-reduce `a` (rank 0) and `b` (rank 1) over shared memory: SUM
/// rounds the fp32 sum once (`float_to_half_bits` / `float_to_bf16_bits` of the core), AVG
/// rounds the fp32 sum's half once (finite where the sum is not). Both must equal
/// from_f32 here, bit for bit.
fn library_rounding<H: Half + hpshard::Element + Send + Sync>(tag: &str) {
    let (a, b) = operands::<H>();
    let (a2, b2) = (a.clone(), b.clone());
    let results = common::run_ranks_on(
        unique_url(tag),
        2,
        tag,
        "half",
        COMM_TIMEOUT,
        RANKS_DEADLINE,
        move |rank, comm: Communicator| {
            let mine = if rank == 0 { a2.clone() } else { b2.clone() };
            let mut sum = vec![H::of(0); mine.len()];
            let mut avg = vec![H::of(0); mine.len()];
            comm.scope(|s| {
                s.all_reduce(&mine, &mut sum, ReduceOp::SUM)?.wait()?;
                s.all_reduce(&mine, &mut avg, ReduceOp::AVG)?.wait()
            })
            .unwrap();
            (sum, avg)
        },
    );
    let mut checked = 0usize;
    for (rank, (sum, avg)) in results.iter().enumerate() {
        for i in 0..a.len() {
            let exact = a[i].to_f32() + b[i].to_f32();
            if exact.is_nan() {
                continue; // inf - inf: the hardware's NaN
            }
            let want_sum = H::from_f32(exact);
            assert_eq!(
                sum[i], want_sum,
                "rank {} SUM of {:?} and {:?} ({:e})",
                rank, a[i], b[i], exact
            );
            let want_avg = H::from_f32(exact / 2.0);
            assert_eq!(
                avg[i], want_avg,
                "rank {} AVG of {:?} and {:?}",
                rank, a[i], b[i]
            );
            checked += 1;
        }
    }
    assert!(checked > 2 * 60_000, "{}", checked);
}

#[test]
fn f16_rounds_as_the_library_does() {
    library_rounding::<F16>("f16");
}

#[test]
fn bf16_rounds_as_the_library_does() {
    library_rounding::<BF16>("bf16");
}
