//! The QUIC stream framing (`wire::msg::FrameDecoder`) fed arbitrary bytes in arbitrary
//! pieces, first with the pre-authentication limit and then (as the gateway does after a
//! Connect is accepted) a larger one: no panic, no frame over the limit in force, and the
//! decoder never holds more than the limit plus one piece when it is drained after each push.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wire::msg::FrameDecoder;

const PRE_AUTH: usize = 4 * 1024;
const AFTER: usize = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    let mut d = FrameDecoder::new(PRE_AUTH);
    let mut max = PRE_AUTH;
    let mut rest = data;
    let mut frames = 0usize;
    while let Some((&len, tail)) = rest.split_first() {
        let take = (len as usize).min(tail.len());
        let (piece, tail) = tail.split_at(take);
        rest = tail;
        d.push(piece);
        loop {
            match d.next_frame() {
                Ok(Some(f)) => {
                    assert!(f.len() <= max, "frame of {} over the limit {max}", f.len());
                    frames += 1;
                    if frames == 1 {
                        // The Connect frame was taken: the stream may carry larger frames now.
                        max = AFTER;
                        d.set_max(AFTER);
                    }
                }
                Ok(None) => break,
                Err(_) => return, // The gateway closes the stream here.
            }
        }
        assert!(
            d.buffered() <= max + 4 + 255,
            "{} bytes held with a limit of {max}",
            d.buffered()
        );
    }
    let _ = d.finish();
});
