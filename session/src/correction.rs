//! The correction note: what her next batch tells her of her last reply when it went nowhere,
//! whole or in part. Pure: the edge says how her reply was handled, this says which note her
//! next batch carries (the edge stores it with the turn, so a restart keeps it).
//!
//! The rules, each unit-tested below:
//! - a reply that could not be read (no structured output, off the schema, a room not hers)
//!   sets the note that says so;
//! - a reply read, some of whose says were refused, sets the note naming each refused say;
//! - a reply read and sent whole clears it;
//! - a turn that ended before any reply (an API error, a dead process) leaves it as it was:
//!   its retry is the same batch, and the note still holds.

use crate::render::{unsent_says_note, ReplyError};

/// How her reply to a turn was handled.
#[derive(Debug)]
pub enum Handled<'a, W: AsRef<str>> {
    /// It could not be read.
    Unread(&'a ReplyError),
    /// It was read: of its `says`, these were refused (room, text, why).
    Read {
        /// Her says in all.
        says: usize,
        /// Those refused.
        refused: &'a [(&'a str, &'a str, W)],
    },
}

/// The note her next batch carries after `handled` (`None`: no correction).
pub fn after<W: AsRef<str>>(handled: Handled<'_, W>) -> Option<String> {
    match handled {
        Handled::Unread(e) => Some(e.correction_note()),
        Handled::Read { refused: [], .. } => None,
        Handled::Read { says, refused } => Some(unsent_says_note(refused, says)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_unread_or_partly_refused_sets_the_note_and_one_sent_whole_clears_it() {
        let unread = after::<&str>(Handled::Unread(&ReplyError::Missing));
        assert!(unread.is_some_and(|n| n.contains("StructuredOutput")));
        let refused = [("!a", "hi", "the homeserver refused it")];
        let partly = after(Handled::Read {
            says: 2,
            refused: &refused,
        });
        assert!(partly.is_some_and(|n| n.contains("!a") && n.contains("refused it")));
        let whole = after::<&str>(Handled::Read {
            says: 2,
            refused: &[],
        });
        assert_eq!(whole, None);
    }
}
