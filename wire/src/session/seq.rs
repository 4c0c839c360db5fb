//! Sequence arithmetic. Sequences are u32 serial numbers that skip 0 on wrap (0 means
//! "unsequenced" under the newer rules), compared by RFC 1982 style serial arithmetic.

/// The sequence after `s`, skipping 0.
pub(crate) fn next(s: u32) -> u32 {
    match s.wrapping_add(1) {
        0 => 1,
        n => n,
    }
}

/// Signed distance from `from` to `to`, not counting the skipped 0.
pub(crate) fn diff(to: u32, from: u32) -> i64 {
    let d = to.wrapping_sub(from) as i32 as i64;
    if d > 0 && to < from {
        d - 1
    } else if d < 0 && to > from {
        d + 1
    } else {
        d
    }
}

/// Whether `a` comes after `b`.
pub(crate) fn after(a: u32, b: u32) -> bool {
    diff(a, b) > 0
}

/// Whether the (ack, mask) pair of a packet covers `s`: the ack names it, or bit `b` of the
/// mask names `ack - b - 1` (plain wrapping arithmetic, as every runtime computes it).
pub(crate) fn covered(ack: u32, mask: u32, s: u32) -> bool {
    if ack == 0 {
        return false;
    }
    if s == ack {
        return true;
    }
    let d = ack.wrapping_sub(s);
    (1..=32).contains(&d) && mask & (1 << (d - 1)) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_skipping_zero() {
        assert_eq!(next(u32::MAX), 1);
        assert_eq!(next(5), 6);
        assert_eq!(diff(1, u32::MAX), 1);
        assert_eq!(diff(u32::MAX, 1), -1);
        assert_eq!(diff(7, 3), 4);
        assert!(after(2, u32::MAX));
        assert!(!after(3, 3));
    }

    #[test]
    fn coverage() {
        assert!(covered(10, 0, 10));
        assert!(covered(10, 1, 9));
        assert!(!covered(10, 1, 8));
        assert!(covered(40, 1 << 31, 8));
        assert!(!covered(0, u32::MAX, 0));
    }
}
