//! A small deterministic generator (SplitMix64): the same seed gives the same kills and the same
//! bad inputs on every machine and every version of every dependency, so a failing case can be
//! replayed by its number.

#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The generator of case `index` of a run seeded with `seed`: cases do not depend on each
    /// other, so one can be replayed alone.
    pub fn for_case(seed: u64, index: u64) -> Self {
        let mut r = Self(seed ^ index.wrapping_mul(0xA076_1D64_78BD_642F));
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0; 0 gives 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Multiply-shift: unbiased enough for picking test cases.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo).saturating_add(1))
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// A copy of one element of a non-empty slice.
    pub fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        let i = self.below(items.len() as u64) as usize;
        items[i.min(items.len().saturating_sub(1))].clone()
    }

    /// A random (v4) UUID drawn from this generator.
    pub fn uuid(&mut self) -> String {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.next_u64().to_le_bytes());
        b[8..].copy_from_slice(&self.next_u64().to_le_bytes());
        uuid::Builder::from_random_bytes(b).into_uuid().to_string()
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_bounds_hold() {
        let a: Vec<u64> = (0..5).map(|_| Rng::new(7).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut r = Rng::for_case(42, 3);
        let mut s = Rng::for_case(42, 3);
        assert_eq!(r.next_u64(), s.next_u64());
        assert_ne!(
            Rng::for_case(42, 3).next_u64(),
            Rng::for_case(42, 4).next_u64()
        );
        for _ in 0..1000 {
            assert!(r.below(10) < 10);
            let v = r.range(5, 7);
            assert!((5..=7).contains(&v));
        }
    }
}
