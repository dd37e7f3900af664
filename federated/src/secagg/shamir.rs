//! Shamir threshold secret sharing of 32-byte secrets over the prime field GF(2^61 - 1). A secret is
//! split into eight 32-bit limbs; each limb is the constant term of its own random polynomial of
//! degree `threshold - 1`, and a share is the eight polynomials evaluated at the holder's point
//! `x = client_id + 1` (client ids are below `2^61 - 2`, so points are distinct and non-zero). Any
//! `threshold` shares recover the secret by Lagrange interpolation at zero; fewer reveal nothing.

use rand::Rng;

/// The field modulus, the Mersenne prime 2^61 - 1.
pub const FIELD_PRIME: u64 = (1 << 61) - 1;
/// Field elements per share of a 32-byte secret.
pub(crate) const SHARE_LIMBS: usize = 8;
/// The largest client id the protocol accepts (its evaluation point `id + 1` must be a non-zero field
/// element).
pub const CLIENT_ID_MAX: u64 = FIELD_PRIME - 2;

/// One holder's share of a 32-byte secret: the eight limb polynomials evaluated at its point.
pub(crate) type ShareLimbs = [u64; SHARE_LIMBS];

/// The evaluation point of a client's shares.
pub(crate) fn point_of(client: u64) -> u64 {
    debug_assert!(client <= CLIENT_ID_MAX);
    client + 1
}

/// Splits `secret` into one share per point in `points`, any `threshold` of which recover it.
pub(crate) fn split<R: Rng>(secret: &[u8; 32], threshold: usize, points: &[u64], rng: &mut R) -> Vec<ShareLimbs> {
    assert!(threshold >= 1 && threshold <= points.len(), "threshold {threshold} of {} points", points.len());
    let mut shares = vec![[0u64; SHARE_LIMBS]; points.len()];
    let mut coefficients = vec![0u64; threshold];
    for limb in 0..SHARE_LIMBS {
        let bytes = [secret[4 * limb], secret[4 * limb + 1], secret[4 * limb + 2], secret[4 * limb + 3]];
        coefficients[0] = u64::from(u32::from_le_bytes(bytes));
        for c in coefficients.iter_mut().skip(1) {
            *c = rng.random_range(0..FIELD_PRIME);
        }
        for (share, &x) in shares.iter_mut().zip(points) {
            // Horner's rule from the highest coefficient down.
            let mut y = 0u64;
            for &c in coefficients.iter().rev() {
                y = add(mul(y, x), c);
            }
            share[limb] = y;
        }
    }
    shares
}

/// Recovers a secret from exactly `threshold` shares at distinct points. Returns `None` when the
/// points repeat or the interpolated limbs do not fit 32 bits (shares inconsistent with any secret).
pub(crate) fn reconstruct(shares: &[(u64, ShareLimbs)]) -> Option<[u8; 32]> {
    let n = shares.len();
    let mut weights = vec![0u64; n];
    for (j, &(xj, _)) in shares.iter().enumerate() {
        let mut num = 1u64;
        let mut den = 1u64;
        for (m, &(xm, _)) in shares.iter().enumerate() {
            if m != j {
                if xm == xj {
                    return None;
                }
                num = mul(num, xm);
                den = mul(den, sub(xm, xj));
            }
        }
        weights[j] = mul(num, inverse(den));
    }
    let mut secret = [0u8; 32];
    for limb in 0..SHARE_LIMBS {
        let mut value = 0u64;
        for (w, (_, share)) in weights.iter().zip(shares) {
            value = add(value, mul(*w, share[limb]));
        }
        let word = u32::try_from(value).ok()?;
        secret[4 * limb..4 * limb + 4].copy_from_slice(&word.to_le_bytes());
    }
    Some(secret)
}

fn reduce(x: u128) -> u64 {
    // x = hi * 2^61 + lo == hi + lo (mod 2^61 - 1).
    let folded = (x & u128::from(FIELD_PRIME)) + (x >> 61);
    let folded = (folded & u128::from(FIELD_PRIME)) + (folded >> 61);
    let r = folded as u64;
    if r >= FIELD_PRIME {
        r - FIELD_PRIME
    } else {
        r
    }
}

fn mul(a: u64, b: u64) -> u64 {
    reduce(u128::from(a) * u128::from(b))
}

fn add(a: u64, b: u64) -> u64 {
    let s = a + b;
    if s >= FIELD_PRIME {
        s - FIELD_PRIME
    } else {
        s
    }
}

fn sub(a: u64, b: u64) -> u64 {
    if a >= b {
        a - b
    } else {
        a + FIELD_PRIME - b
    }
}

fn inverse(a: u64) -> u64 {
    debug_assert!(a != 0);
    // Fermat: a^(p-2).
    let mut result = 1u64;
    let mut base = a;
    let mut e = FIELD_PRIME - 2;
    while e > 0 {
        if e & 1 == 1 {
            result = mul(result, base);
        }
        base = mul(base, base);
        e >>= 1;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha20Rng;

    #[test]
    fn any_threshold_subset_recovers_and_fewer_do_not() {
        // Goal: every t-subset of the shares gives the secret; t-1 shares plus a forged one do not.
        let mut rng = ChaCha20Rng::seed_from_u64(7);
        let secret: [u8; 32] = rng.random();
        let points: Vec<u64> = (0..6u64).map(|c| point_of(c * 1000 + 3)).collect();
        let shares = split(&secret, 3, &points, &mut rng);
        for a in 0..6 {
            for b in a + 1..6 {
                for c in b + 1..6 {
                    let subset = [(points[a], shares[a]), (points[b], shares[b]), (points[c], shares[c])];
                    assert_eq!(reconstruct(&subset), Some(secret));
                }
            }
        }
        let mut forged = shares[2];
        forged[0] = add(forged[0], 1);
        let bad = [(points[0], shares[0]), (points[1], shares[1]), (points[2], forged)];
        assert_ne!(reconstruct(&bad), Some(secret));
        assert_eq!(mul(inverse(12345), 12345), 1);
    }
}
