//! Her replies' Markdown, rendered as the HTML a Matrix client shows.
//!
//! A Persona writes Markdown, not HTML: `Vec<String>`, `<3` or `<name>` in her prose are
//! characters she means the room to read. CommonMark passes such text through as raw HTML, and
//! a client's sanitizer then drops the tags it does not know, so `Vec<String>` would show as
//! `Vec`. Here raw HTML is text like any other: escaped where it is rendered, and no reason by
//! itself to send HTML at all.
//!
//! Otherwise this follows ruma's `FormattedBody::markdown` (which matrix-sdk's composer
//! helpers use): tables and strikethrough on, a single newline a line break, no HTML for text
//! without Markdown, and the paragraph around inline-only text left out as the spec asks.

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

const OPTIONS: Options = Options::ENABLE_TABLES.union(Options::ENABLE_STRIKETHROUGH);

/// The HTML for `text` when it has Markdown in it, `None` when the plain text says it all.
pub fn to_html(text: &str) -> Option<String> {
    let events: Vec<Event<'_>> = Parser::new_ext(text, OPTIONS)
        .map(|event| match event {
            Event::SoftBreak => Event::HardBreak,
            // Raw HTML is her text, not markup: rendered escaped.
            Event::Html(s) | Event::InlineHtml(s) => Event::Text(s),
            other => other,
        })
        .collect();
    if events.is_empty() {
        return None;
    }
    // One paragraph of inline content only: rendered without its <p>, or not at all if plain.
    let inline = match events.as_slice() {
        [Event::Start(Tag::Paragraph), inner @ .., Event::End(TagEnd::Paragraph)]
            if !inner
                .iter()
                .any(|e| matches!(e, Event::Start(t) if is_block(t))) =>
        {
            if is_plain(text, inner) {
                return None;
            }
            Some(inner)
        }
        _ => None,
    };
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, inline.unwrap_or(&events).iter().cloned());
    Some(html)
}

/// Whether a paragraph's inner events give back its source unchanged but for line breaks: text
/// that needs no HTML. Walks the source beside the text events; anything else, or a character
/// the parser took as syntax (an escape, an entity), means Markdown.
fn is_plain(text: &str, events: &[Event<'_>]) -> bool {
    let mut pos = 0;
    for event in events {
        match event {
            Event::Text(s) if text[pos..].starts_with(s.as_ref()) => pos += s.len(),
            Event::HardBreak => {
                let rest = &text[pos..];
                if rest.starts_with("\r\n") {
                    pos += 2;
                } else if rest.starts_with(['\r', '\n']) {
                    pos += 1;
                } else {
                    // A hard break written as Markdown (two spaces or a backslash).
                    return false;
                }
            }
            _ => return false,
        }
    }
    pos == text.len()
}

/// `text` with the first mention of each of `pills`' names (as a whole word, outside code)
/// made a Markdown link to its user (`https://matrix.to/#/@user`): the pill a client shows.
/// The plain body keeps the name as written.
pub fn with_pills(text: &str, pills: &[(String, String)]) -> String {
    // Each name's first place in the text as written (a link made for one name is never
    // searched for the next), then the links put in from the back, so earlier places hold.
    let mut places: Vec<(usize, &str, &str)> = Vec::new();
    for (user, name) in pills {
        let Some(at) = word_at(text, name) else {
            continue;
        };
        let overlaps = places
            .iter()
            .any(|(p, _, n)| at < p + n.len() && *p < at + name.len());
        if !overlaps {
            places.push((at, user, name));
        }
    }
    places.sort_by_key(|(at, ..)| std::cmp::Reverse(*at));
    let mut out = text.to_owned();
    for (at, user, name) in places {
        let written = &text[at..at + name.len()];
        let mut label = String::new();
        for c in written.chars() {
            if matches!(c, '[' | ']' | '\\' | '*' | '_' | '`') {
                label.push('\\');
            }
            label.push(c);
        }
        let link = format!("[{label}](https://matrix.to/#/{})", url_part(user));
        out.replace_range(at..at + name.len(), &link);
    }
    out
}

/// Where `needle` first occurs in `hay` as a whole word (case-insensitive, ASCII case only so
/// byte positions hold), outside a code span.
fn word_at(hay: &str, needle: &str) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    let lower = hay.to_ascii_lowercase();
    let want = needle.to_ascii_lowercase();
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    lower.match_indices(&want).map(|(i, _)| i).find(|&i| {
        !word(hay[..i].chars().next_back())
            && !word(hay[i + needle.len()..].chars().next())
            && hay[..i].matches('`').count().is_multiple_of(2)
    })
}

/// A user id as a URL fragment: its characters that need it percent-encoded.
fn url_part(user: &str) -> String {
    let mut out = String::new();
    for b in user.bytes() {
        if b.is_ascii_alphanumeric() || b"@:._=-/+".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn is_block(tag: &Tag<'_>) -> bool {
    matches!(
        tag,
        Tag::Paragraph
            | Tag::Heading { .. }
            | Tag::BlockQuote(_)
            | Tag::CodeBlock(_)
            | Tag::HtmlBlock
            | Tag::List(_)
            | Tag::FootnoteDefinition(_)
            | Tag::Table(_)
    )
}

#[cfg(test)]
mod tests {
    use super::{to_html, with_pills};

    #[test]
    fn a_mentioned_name_becomes_a_pill_once_and_only_as_a_word() {
        let ann = [("@ann:l".to_owned(), "Ann".to_owned())];
        let text = with_pills("thanks ann, and Anne too; ann again", &ann);
        assert_eq!(
            text,
            "thanks [ann](https://matrix.to/#/@ann:l), and Anne too; ann again"
        );
        assert_eq!(
            to_html(&text).as_deref(),
            Some("thanks <a href=\"https://matrix.to/#/@ann:l\">ann</a>, and Anne too; ann again")
        );
        // Not inside code, and names with Markdown in them stay text.
        assert_eq!(with_pills("`ann` is here", &ann), "`ann` is here");
        let odd = [("@x_y:l".to_owned(), "x_y".to_owned())];
        assert_eq!(
            with_pills("hi x_y", &odd),
            "hi [x\\_y](https://matrix.to/#/@x_y:l)"
        );
        assert_eq!(with_pills("no one here", &ann), "no one here");
        // A later name is never found inside the link made for an earlier one, and each
        // name's link goes where the name was written.
        let two = [
            ("@ann:l".to_owned(), "ann".to_owned()),
            ("@m:l".to_owned(), "matrix".to_owned()),
        ];
        assert_eq!(
            with_pills("ann asked matrix", &two),
            "[ann](https://matrix.to/#/@ann:l) asked [matrix](https://matrix.to/#/@m:l)"
        );
    }

    /// Each text's HTML, or `None` for text sent plain.
    fn renders(cases: &[(&str, Option<&str>)]) {
        for (text, html) in cases {
            assert_eq!(to_html(text).as_deref(), *html, "{text:?}");
        }
    }

    #[test]
    fn plain_text_needs_no_html() {
        renders(&[
            ("Hello world.", None),
            ("Hello\nworld.", None),
            ("Hello\r\nworld.", None),
            ("", None),
            ("5 < 6 and 7 > 3", None),
        ]);
    }

    #[test]
    fn markdown_is_rendered_and_inline_text_keeps_no_paragraph() {
        renders(&[
            (
                "**bold** and `code`",
                Some("<strong>bold</strong> and <code>code</code>"),
            ),
            ("Hello\n\nworld.", Some("<p>Hello</p>\n<p>world.</p>\n")),
            ("a *b*\nc", Some("a <em>b</em><br />\nc")),
            (
                "| a | b |\n|---|---|\n| 1 | ~~2~~ |",
                Some(
                    "<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody>\n\
                     <tr><td>1</td><td><del>2</del></td></tr>\n</tbody></table>\n",
                ),
            ),
            // An escape is Markdown: the backslash must not show.
            (r"\*not bold\*", Some("*not bold*")),
        ]);
    }

    #[test]
    fn raw_html_is_her_text_not_markup() {
        renders(&[
            // Alone it is plain text: the body says it as she wrote it.
            ("a Vec<String> of names", None),
            ("I <3 you", None),
            ("<b>not bold</b>", None),
            // Beside Markdown it is rendered escaped, so a client shows it, not obeys or
            // drops it.
            (
                "a **Vec<String>** of <name>",
                Some("a <strong>Vec&lt;String&gt;</strong> of &lt;name&gt;"),
            ),
            (
                "<script>alert(1)</script>\n\n*hi*",
                Some("&lt;script&gt;alert(1)&lt;/script&gt;\n<p><em>hi</em></p>\n"),
            ),
            // Inside code it was always text.
            ("`Vec<String>`", Some("<code>Vec&lt;String&gt;</code>")),
        ]);
    }
}
