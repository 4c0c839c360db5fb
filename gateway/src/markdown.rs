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
    let inline = matches!(events.first(), Some(Event::Start(Tag::Paragraph)))
        && matches!(events.last(), Some(Event::End(TagEnd::Paragraph)))
        && !events.iter().skip(1).any(|e| match e {
            Event::Start(tag) => is_block(tag),
            _ => false,
        });
    if inline && is_plain(text, &events[1..]) {
        return None;
    }
    let mut html = String::new();
    let body = if inline {
        &events[1..events.len() - 1]
    } else {
        &events[..]
    };
    pulldown_cmark::html::push_html(&mut html, body.iter().cloned());
    Some(html)
}

/// Whether one paragraph's events give back its source unchanged but for line breaks: text
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
            Event::End(TagEnd::Paragraph) => {}
            _ => return false,
        }
    }
    pos == text.len()
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
    use super::to_html;

    #[test]
    fn plain_text_needs_no_html() {
        assert_eq!(to_html("Hello world."), None);
        assert_eq!(to_html("Hello\nworld."), None);
        assert_eq!(to_html("Hello\r\nworld."), None);
        assert_eq!(to_html(""), None);
        assert_eq!(to_html("5 < 6 and 7 > 3"), None);
    }

    #[test]
    fn markdown_is_rendered_and_inline_text_keeps_no_paragraph() {
        assert_eq!(
            to_html("**bold** and `code`").as_deref(),
            Some("<strong>bold</strong> and <code>code</code>")
        );
        assert_eq!(
            to_html("Hello\n\nworld.").as_deref(),
            Some("<p>Hello</p>\n<p>world.</p>\n")
        );
        assert_eq!(
            to_html("a *b*\nc").as_deref(),
            Some("a <em>b</em><br />\nc")
        );
        assert_eq!(
            to_html("| a | b |\n|---|---|\n| 1 | ~~2~~ |").as_deref(),
            Some(
                "<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody>\n\
                 <tr><td>1</td><td><del>2</del></td></tr>\n</tbody></table>\n"
            )
        );
        // An escape is Markdown: the backslash must not show.
        assert_eq!(to_html(r"\*not bold\*").as_deref(), Some("*not bold*"));
    }

    #[test]
    fn raw_html_is_her_text_not_markup() {
        // Alone it is plain text: the body says it as she wrote it.
        assert_eq!(to_html("a Vec<String> of names"), None);
        assert_eq!(to_html("I <3 you"), None);
        assert_eq!(to_html("<b>not bold</b>"), None);
        // Beside Markdown it is rendered escaped, so a client shows it, not obeys or drops it.
        assert_eq!(
            to_html("a **Vec<String>** of <name>").as_deref(),
            Some("a <strong>Vec&lt;String&gt;</strong> of &lt;name&gt;")
        );
        assert_eq!(
            to_html("<script>alert(1)</script>\n\n*hi*").as_deref(),
            Some("&lt;script&gt;alert(1)&lt;/script&gt;\n<p><em>hi</em></p>\n")
        );
        // Inside code it was always text.
        assert_eq!(
            to_html("`Vec<String>`").as_deref(),
            Some("<code>Vec&lt;String&gt;</code>")
        );
    }
}
