//! Chat `messages`: read in the body's one pass, rendered canonically.
//!
//! The array and each message object are walked here, so that a message's
//! text, most of a chat body, goes to the fast string reader; the other
//! values are read by serde.

use super::json_string::read_string;
use super::{first_time, json_value, read_into, skip_whitespace, walk_object, Given, ParseError};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use xxhash_rust::xxh3::xxh3_64;

/// Separates a message's role from its content in the rendering.
const ROLE_END: u8 = 0x1f;
/// Ends a message in the rendering.
const MESSAGE_END: u8 = 0x1e;
/// Brackets the digest of a non-text part.
const PART_MARK: u8 = 0x1d;

/// Names a message in errors.
const WHAT: &str = "message";

/// One message of `messages`, as read.
pub(super) struct RawMessage<'a> {
    role: Cow<'a, str>,
    name: Option<Cow<'a, str>>,
    content: Option<RawContent<'a>>,
    tool_calls: Option<&'a RawValue>,
}

/// A message's content: its text (borrowed when it has no escapes), or
/// its parts.
enum RawContent<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<&'a RawValue>),
}

#[derive(Deserialize)]
struct RawPart<'a> {
    #[serde(borrow, rename = "type")]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// `messages`: an array of message objects, or null. The messages and
/// the bytes taken.
pub(super) fn read_messages(
    value: &[u8],
) -> Result<(Option<Vec<RawMessage<'_>>>, usize), ParseError> {
    if value.first() != Some(&b'[') {
        // null, or the type error serde words.
        let (_, used) = json_value::<Option<Vec<IgnoredAny>>>(value)?;
        return Ok((None, used));
    }
    let mut messages = Vec::new();
    let mut i = skip_whitespace(value, 1);
    if value.get(i) == Some(&b']') {
        return Ok((Some(messages), i + 1));
    }
    loop {
        let (message, used) = read_message(&value[i..])?;
        messages.push(message);
        i = skip_whitespace(value, i + used);
        match value.get(i) {
            Some(b',') => i = skip_whitespace(value, i + 1),
            Some(b']') => return Ok((Some(messages), i + 1)),
            _ => {
                return Err(ParseError::Malformed(
                    "messages: expected ',' or ']' after a message".into(),
                ))
            }
        }
    }
}

/// The message object at the start of `value`, and the bytes it took.
fn read_message(value: &[u8]) -> Result<(RawMessage<'_>, usize), ParseError> {
    let mut role: Given<Cow<str>> = None;
    let mut name: Given<Cow<str>> = None;
    let mut content: Given<RawContent> = None;
    let mut tool_calls: Given<&RawValue> = None;
    let used = walk_object(value, WHAT, |key, value| match key.as_ref() {
        "role" => read_into(&mut role, WHAT, &key, value),
        "name" => read_into(&mut name, WHAT, &key, value),
        "content" => read_content(&mut content, &key, value),
        "tool_calls" => read_into(&mut tool_calls, WHAT, &key, value),
        _ => Ok(json_value::<IgnoredAny>(value)?.1),
    })?;
    let role = role
        .flatten()
        .ok_or_else(|| ParseError::Malformed(format!("{WHAT}: missing field `role`")))?;
    let message = RawMessage {
        role,
        name: name.flatten(),
        content: content.flatten(),
        tool_calls: tool_calls.flatten(),
    };
    Ok((message, used))
}

/// A message's `content`: text goes to the string reader, parts (or
/// null) to serde.
fn read_content<'a>(
    slot: &mut Given<RawContent<'a>>,
    key: &str,
    value: &'a [u8],
) -> Result<usize, ParseError> {
    first_time(slot, WHAT, key)?;
    if value.first() == Some(&b'"') {
        let (text, used) = read_string(value)?;
        *slot = Some(Some(RawContent::Text(text)));
        return Ok(used);
    }
    let (parts, used) = json_value::<Option<Vec<&RawValue>>>(value).map_err(|e| match e {
        ParseError::Malformed(why) => ParseError::Malformed(format!(
            "message content must be a string, parts or null: {why}"
        )),
        other => other,
    })?;
    *slot = Some(parts.map(RawContent::Parts));
    Ok(used)
}

/// Canonical rendering of chat messages: for each message
/// `role[:name] 0x1F content 0x1E`, where content is the text (string content
/// or the text parts in order) and each non-text part is `0x1D type:digest 0x1D`
/// with the XXH3 digest of its canonical JSON (keys sorted). Earlier messages
/// render the same whatever follows, so conversations share prefixes. Also
/// tells whether any content part was not text.
pub(super) fn render_messages(messages: &[RawMessage]) -> Result<(Vec<u8>, bool), ParseError> {
    if messages.is_empty() {
        return Err(ParseError::NoPrompt);
    }
    let mut out = Vec::with_capacity(
        messages
            .iter()
            .map(|m| match &m.content {
                Some(RawContent::Text(text)) => text.len(),
                Some(RawContent::Parts(parts)) => parts.iter().map(|p| p.get().len()).sum(),
                None => 0,
            })
            .sum::<usize>()
            + 16,
    );
    let mut non_text = false;
    for message in messages {
        out.extend_from_slice(message.role.as_bytes());
        if let Some(name) = &message.name {
            out.push(b':');
            out.extend_from_slice(name.as_bytes());
        }
        out.push(ROLE_END);
        if let Some(content) = &message.content {
            non_text |= render_content(content, &mut out)?;
        }
        if let Some(calls) = message.tool_calls {
            push_digest("tool_calls", calls, &mut out)?;
        }
        out.push(MESSAGE_END);
    }
    Ok((out, non_text))
}

/// Renders one message's content; true when it had a non-text part.
fn render_content(content: &RawContent, out: &mut Vec<u8>) -> Result<bool, ParseError> {
    let mut non_text = false;
    match content {
        RawContent::Text(text) => out.extend_from_slice(text.as_bytes()),
        RawContent::Parts(parts) => {
            for part in parts {
                let parsed: RawPart = serde_json::from_str(part.get())?;
                match (parsed.kind.as_ref(), parsed.text) {
                    ("text", Some(t)) => out.extend_from_slice(t.as_bytes()),
                    (kind, _) => {
                        non_text = true;
                        push_digest(kind, part, out)?
                    }
                }
            }
        }
    }
    Ok(non_text)
}

fn push_digest(kind: &str, raw: &RawValue, out: &mut Vec<u8>) -> Result<(), ParseError> {
    // Canonical JSON (serde_json's map is sorted) so key order and spacing of
    // the client do not change the digest.
    let canonical = serde_json::from_str::<serde_json::Value>(raw.get())?.to_string();
    out.push(PART_MARK);
    out.extend_from_slice(kind.as_bytes());
    out.push(b':');
    out.extend_from_slice(format!("{:016x}", xxh3_64(canonical.as_bytes())).as_bytes());
    out.push(PART_MARK);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::xorshift;

    /// serde's derive, as messages were read before the walk: the reference.
    #[derive(Deserialize)]
    struct DerivedMessage<'a> {
        #[serde(borrow)]
        role: Cow<'a, str>,
        #[serde(borrow, default)]
        name: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        content: Option<&'a RawValue>,
        #[serde(borrow, default)]
        tool_calls: Option<&'a RawValue>,
    }

    /// Content as serde reads it: a string, else parts.
    fn content_by_serde(raw: &RawValue) -> Option<RawContent<'_>> {
        match serde_json::from_str::<Cow<str>>(raw.get()) {
            Ok(text) => Some(RawContent::Text(text)),
            Err(_) => serde_json::from_str(raw.get()).ok().map(RawContent::Parts),
        }
    }

    fn rendered_by_serde(value: &[u8]) -> Option<(Vec<u8>, bool)> {
        let derived: Vec<DerivedMessage> = serde_json::from_slice(value).ok()?;
        let messages: Option<Vec<RawMessage>> = derived
            .into_iter()
            .map(|m| {
                let content = match m.content {
                    Some(raw) => Some(content_by_serde(raw)?),
                    None => None,
                };
                Some(RawMessage {
                    role: m.role,
                    name: m.name,
                    content,
                    tool_calls: m.tool_calls,
                })
            })
            .collect();
        render_messages(&messages?).ok()
    }

    fn rendered_by_walk(value: &[u8]) -> Option<(Vec<u8>, bool)> {
        let (messages, used) = read_messages(value).ok()?;
        assert_eq!(used, value.len());
        render_messages(&messages?).ok()
    }

    /// Fields of a message; those that share a key are alternatives.
    const FIELDS: [(&str, &str); 12] = [
        ("role", r#""role":"user""#),
        ("role", r#""role":"assistant""#),
        ("name", r#""name":"ann""#),
        ("name", r#""name":null"#),
        ("content", r#""content":"plain text""#),
        (
            "content",
            r#""content":"line\nnext \"quoted\" caf\u00e9 日本 \ud83d\ude00""#,
        ),
        ("content", r#""content":null"#),
        (
            "content",
            r#""content":[{"type":"text","text":"a\tb"},{"type":"image_url","image_url":{"url":"u"}}]"#,
        ),
        (
            "tool_calls",
            r#""tool_calls":[{"id":"1","function":{"name":"f"}}]"#,
        ),
        ("weight", r#""weight":1.5"#),
        ("extra", r#""extra":{"content":"not this"}"#),
        ("content", r#""content":7"#),
    ];

    #[test]
    fn the_walk_reads_messages_as_serde_derive_did() {
        let mut next = xorshift(0x5851_f42d_4c95_7f2d);
        let (mut rendered, mut refused) = (0, 0);
        for _ in 0..5_000 {
            let messages: Vec<String> = (0..1 + next() % 4)
                .map(|_| {
                    let mut fields: Vec<(&str, &str)> = Vec::new();
                    for _ in 0..1 + next() % 6 {
                        let field = FIELDS[next() as usize % FIELDS.len()];
                        // A key given twice, now and then.
                        if next() % 16 == 0 || fields.iter().all(|f| f.0 != field.0) {
                            fields.push(field);
                        }
                    }
                    let fields: Vec<&str> = fields.iter().map(|f| f.1).collect();
                    format!("{{ {} }}", fields.join(" , "))
                })
                .collect();
            let value = format!("[{}]", messages.join(",\n"));
            let walked = rendered_by_walk(value.as_bytes());
            assert_eq!(walked, rendered_by_serde(value.as_bytes()), "{value}");
            rendered += usize::from(walked.is_some());
            refused += usize::from(walked.is_none());
        }
        // Both outcomes are common: missing or repeated keys and integer contents refuse.
        assert!(rendered > 500 && refused > 500, "{rendered} {refused}");
    }

    #[test]
    fn messages_that_are_not_an_array_of_objects_are_refused() {
        assert!(matches!(read_messages(b"null"), Ok((None, 4))));
        let Err(ParseError::Malformed(why)) = read_messages(br#"[{"role":"user","content":7}]"#)
        else {
            panic!("an integer content is refused")
        };
        assert!(
            why.starts_with("message content must be a string, parts or null: invalid type"),
            "{why}"
        );
        for bad in [
            &b"{}"[..],
            b"\"x\"",
            b"[1]",
            b"[{\"role\":\"user\"} {\"role\":\"user\"}]",
            b"[{\"role\":\"user\"},]",
            b"[{\"role\":\"user\"}",
            b"[{\"content\":\"no role\"}]",
            b"[{\"role\":null}]",
            b"[{\"role\":\"user\",\"content\":7}]",
        ] {
            assert!(
                matches!(read_messages(bad), Err(ParseError::Malformed(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
