//! The one wall clock: milliseconds since the epoch, as Matrix stamps events and the inbox,
//! the history and the budget keep time. Pure parts (`session`, `wire`) take it as an argument.

/// Now, in ms since the epoch (0 if the clock is before it).
pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
