//! Media in her live session's batches: an image is given to her as an image, a small text
//! file as its text, anything else as its description (name, type, size, duration: made by
//! [`crate::event`] when the event arrived). Fetched (and decrypted, for encrypted rooms) with
//! matrix-sdk when her turn is composed; a fetch that fails leaves the description, with a
//! warning, and never fails the turn.
//!
//! What to do with a file is decided by [`usage`] (pure); [`file_text`] writes a text file's
//! content under its line, where the batch indents every line of it as data.

use std::collections::HashMap;

use matrix_sdk::media::{MediaFormat, MediaRequestParameters};
use matrix_sdk::ruma::events::room::message::{MessageType, RoomMessageEventContent};
use matrix_sdk::ruma::events::room::MediaSource;
use matrix_sdk::Client;
use session::proto::Image;
use wire::docs::{Delivery, DeliveryKind};

use crate::config::Limits;

/// The image types the Messages API reads.
pub const IMAGE_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// What a media event gives her.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    /// An image block.
    Image,
    /// Its text, under its line.
    Text,
    /// Its description only.
    Describe,
}

/// Decides by the event's `msgtype`, its declared type and size (`None`: not given; checked
/// again on the bytes) and her limits.
pub fn usage(msgtype: &str, mimetype: Option<&str>, size: Option<u64>, limits: &Limits) -> Usage {
    let fits = |max: u64| size.is_none_or(|s| s <= max);
    match (msgtype, mimetype) {
        ("m.image", Some(t)) if IMAGE_TYPES.contains(&t) && fits(limits.max_image_bytes) => {
            Usage::Image
        }
        ("m.file", Some(t)) if t.starts_with("text/") && fits(limits.max_text_file_bytes) => {
            Usage::Text
        }
        _ => Usage::Describe,
    }
}

/// A text file's line: its description, then its content between two marker lines (the
/// batch indents them all under the speaker's line, so nothing in the file can pass for the
/// gateway's sections or another speaker).
pub fn file_text(description: &str, bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    format!(
        "{description}\n--- the file's text ({} bytes) ---\n{}\n--- end of the file ---",
        bytes.len(),
        text.trim_end_matches(['\n', '\r'])
    )
}

/// What her batch's media give her: texts that replace deliveries' (by event id), and the
/// images to send after the batch's text.
#[derive(Debug, Default)]
pub struct Prepared {
    /// Event id -> the delivery's text as she is shown it.
    pub texts: HashMap<String, String>,
    /// In the order the batch shows them.
    pub images: Vec<Image>,
}

impl Prepared {
    /// `batch` with the prepared texts in place.
    pub fn apply(&self, batch: &[Delivery]) -> Vec<Delivery> {
        batch
            .iter()
            .map(|d| match self.texts.get(&d.event_id) {
                Some(t) => Delivery {
                    text: t.clone(),
                    ..d.clone()
                },
                None => d.clone(),
            })
            .collect()
    }
}

/// Fetches the images and text files of `batch` within `limits`.
pub async fn prepare(
    client: &Client,
    persona: &str,
    batch: &[Delivery],
    limits: &Limits,
) -> Prepared {
    let mut out = Prepared::default();
    for d in batch.iter().filter(|d| d.kind == DeliveryKind::Media) {
        let Some((msgtype, mimetype, size, source)) = media_of(client, d).await else {
            continue;
        };
        let use_ = usage(&msgtype, mimetype.as_deref(), size, limits);
        if use_ == Usage::Describe {
            continue;
        }
        let params = MediaRequestParameters {
            source,
            format: MediaFormat::File,
        };
        let bytes = match client.media().get_media_content(&params, true).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(persona, event = %d.event_id, "media not fetched; she gets its description: {e}");
                continue;
            }
        };
        let len = bytes.len() as u64;
        match (use_, mimetype) {
            (Usage::Image, Some(t)) if len <= limits.max_image_bytes => {
                out.images.push(Image {
                    media_type: t,
                    data: bytes,
                });
                out.texts.insert(
                    d.event_id.clone(),
                    format!("{} (image {} attached)", d.text, out.images.len()),
                );
            }
            (Usage::Text, _) if len <= limits.max_text_file_bytes => {
                out.texts
                    .insert(d.event_id.clone(), file_text(&d.text, &bytes));
            }
            _ => {}
        }
    }
    out
}

/// A media event's msgtype, declared type and size, and its source (plain or encrypted).
async fn media_of(
    client: &Client,
    d: &Delivery,
) -> Option<(String, Option<String>, Option<u64>, MediaSource)> {
    let room_id = matrix_sdk::ruma::OwnedRoomId::try_from(d.room_id.as_str()).ok()?;
    let event_id = matrix_sdk::ruma::OwnedEventId::try_from(d.event_id.as_str()).ok()?;
    let room = client.get_room(&room_id)?;
    let ev = room.event(&event_id, None).await.ok()?;
    let content: RoomMessageEventContent = ev.raw().get_field("content").ok()??;
    let (msgtype, info, source) = match content.msgtype {
        MessageType::Image(c) => ("m.image", c.info.map(|i| (i.mimetype, i.size)), c.source),
        MessageType::File(c) => ("m.file", c.info.map(|i| (i.mimetype, i.size)), c.source),
        _ => return None,
    };
    let (mimetype, size) = info.unwrap_or_default();
    Some((msgtype.to_owned(), mimetype, size.map(u64::from), source))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_and_small_text_files_are_given_the_rest_described() {
        let l = Limits::default();
        assert_eq!(
            usage("m.image", Some("image/png"), Some(2048), &l),
            Usage::Image
        );
        assert_eq!(usage("m.image", Some("image/png"), None, &l), Usage::Image);
        assert_eq!(
            usage(
                "m.image",
                Some("image/png"),
                Some(l.max_image_bytes + 1),
                &l
            ),
            Usage::Describe
        );
        assert_eq!(
            usage("m.image", Some("image/tiff"), Some(10), &l),
            Usage::Describe
        );
        assert_eq!(usage("m.image", None, Some(10), &l), Usage::Describe);
        assert_eq!(
            usage("m.file", Some("text/plain"), Some(2048), &l),
            Usage::Text
        );
        assert_eq!(
            usage("m.file", Some("text/markdown"), Some(50 << 20), &l),
            Usage::Describe
        );
        assert_eq!(
            usage("m.file", Some("application/pdf"), Some(10), &l),
            Usage::Describe
        );
        assert_eq!(
            usage("m.video", Some("video/mp4"), Some(10), &l),
            Usage::Describe
        );
    }

    #[test]
    fn a_text_files_content_sits_between_its_markers() {
        let t = file_text(
            "[m.file notes.txt, text/plain, 12 B] notes.txt",
            b"line one\nline two\n",
        );
        assert_eq!(
            t,
            "[m.file notes.txt, text/plain, 12 B] notes.txt\n--- the file's text (18 bytes) ---\nline one\nline two\n--- end of the file ---"
        );
        // Not UTF-8: shown with replacement characters, never an error.
        assert!(file_text("x", &[0xff, b'a']).contains("\u{fffd}a"));
    }
}
