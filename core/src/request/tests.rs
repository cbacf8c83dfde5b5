use super::*;
use crate::test_rng::xorshift;

fn text(body: &str) -> Vec<u8> {
    match parse_request(body.as_bytes()).unwrap().prompt {
        Prompt::Text(t) => t,
        other => panic!("expected text, got {other:?}"),
    }
}

fn tokens(body: &str) -> Vec<u32> {
    match parse_request(body.as_bytes()).unwrap().prompt {
        Prompt::Tokens(t) => t,
        other => panic!("expected tokens, got {other:?}"),
    }
}

#[test]
fn chat_messages_render_canonically() {
    let rendered = text(
        r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","name":"ann","content":"Hi \u00e9"}]}"#,
    );
    assert_eq!(
        rendered,
        "system\u{1f}Be brief.\u{1e}user:ann\u{1f}Hi é\u{1e}".as_bytes()
    );
}

#[test]
fn earlier_messages_render_the_same_whatever_follows() {
    let one = text(r#"{"model":"m","messages":[{"role":"system","content":"S"}]}"#);
    let two = text(
        r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"Q"}]}"#,
    );
    assert!(two.starts_with(&one));
}

#[test]
fn text_parts_concatenate_and_other_parts_digest_stably() {
    let a = text(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look "},{"type":"image_url","image_url":{"url":"data:x","detail":"low"}}]}]}"#,
    );
    let b = text(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look "},{"image_url":{"detail":"low","url":"data:x"},"type":"image_url"}]}]}"#,
    );
    let c = text(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look "},{"type":"image_url","image_url":{"url":"data:y"}}]}]}"#,
    );
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!(a.starts_with(b"user\x1flook \x1dimage_url:"));
}

#[test]
fn tool_calls_and_null_content() {
    let r = text(
        r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}"#,
    );
    assert!(r.starts_with(b"assistant\x1f\x1dtool_calls:"));
}

#[test]
fn completion_prompt_forms() {
    assert_eq!(text(r#"{"model":"m","prompt":"hello"}"#), b"hello");
    assert_eq!(
        text(r#"{"model":"m","prompt":"caf\u00e9\n"}"#),
        "café\n".as_bytes()
    );
    assert_eq!(
        text(r#"{"model":"m","prompt":["first","second"]}"#),
        b"first"
    );
    assert_eq!(tokens(r#"{"model":"m","prompt":[1,2,3]}"#), vec![1, 2, 3]);
    assert_eq!(
        tokens(r#"{"model":"m","prompt":[ [4,5], [6] ]}"#),
        vec![4, 5]
    );
}

#[test]
fn chat_token_ids_win_over_messages() {
    assert_eq!(
        tokens(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"prompt_token_ids":[9,8]}"#
        ),
        vec![9, 8]
    );
}

#[test]
fn unknown_fields_are_ignored() {
    let r = parse_request(
        br#"{"model":"m","prompt":"p","stream":true,"extra":{"deep":[1,2]},"max_tokens":5}"#,
    )
    .unwrap();
    assert_eq!(r.model, "m");
}

#[test]
fn bad_bodies_give_typed_errors() {
    type Check = fn(&ParseError) -> bool;
    let cases: &[(&[u8], Check)] = &[
        (b"", |e| matches!(e, ParseError::Malformed(_))),
        (b"{", |e| matches!(e, ParseError::Malformed(_))),
        (b"[1,2]", |e| matches!(e, ParseError::Malformed(_))),
        (b"\xff\xfe{}", |e| matches!(e, ParseError::Malformed(_))),
        (br#"{"model":"m"}"#, |e| *e == ParseError::NoPrompt),
        (br#"{"model":"m","messages":[]}"#, |e| {
            *e == ParseError::NoPrompt
        }),
        (br#"{"model":"m","prompt":[]}"#, |e| {
            *e == ParseError::NoPrompt
        }),
        (br#"{"model":"m","prompt":null}"#, |e| {
            *e == ParseError::NoPrompt
        }),
        (br#"{"model":"m","prompt":[-1]}"#, |e| {
            matches!(e, ParseError::Malformed(_))
        }),
        (br#"{"model":"m","prompt":[1.5]}"#, |e| {
            matches!(e, ParseError::Malformed(_))
        }),
        (br#"{"model":"m","prompt":7}"#, |e| {
            matches!(e, ParseError::Malformed(_))
        }),
        (br#"{"model":"m","prompt_token_ids":"1 2"}"#, |e| {
            matches!(e, ParseError::Malformed(_))
        }),
        (br#"{"model":"m","prompt":"bad \x"}"#, |e| {
            matches!(e, ParseError::Malformed(_))
        }),
        (br#"{"model":7,"prompt":"p"}"#, |e| {
            matches!(e, ParseError::Malformed(_))
        }),
        (br#"{"model":"m","messages":[{"content":"x"}]}"#, |e| {
            matches!(e, ParseError::Malformed(_))
        }),
        (
            br#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
            |e| matches!(e, ParseError::Malformed(_)),
        ),
        (
            br#"{"model":"m","messages":[{"role":"user","content":{"text":"x"}}]}"#,
            |e| matches!(e, ParseError::Malformed(_)),
        ),
        (
            br#"{"model":"m","messages":[{"role":"user","content":true}]}"#,
            |e| matches!(e, ParseError::Malformed(_)),
        ),
        (
            br#"{"model":"m","messages":[{"role":"user","content":[{"text":"no type"}]}]}"#,
            |e| matches!(e, ParseError::Malformed(_)),
        ),
    ];
    for (body, check) in cases {
        let e = parse_request(body).unwrap_err();
        assert!(check(&e), "{:?} gave {e:?}", String::from_utf8_lossy(body));
    }
}

#[test]
fn model_is_optional_and_salt_is_kept() {
    let r = parse_request(br#"{"prompt":"p","cache_salt":"tenant-a"}"#).unwrap();
    assert_eq!(r.model, "");
    assert_eq!(r.cache_salt.as_deref(), Some("tenant-a"));
    assert!(!r.multimodal);
    let r = parse_request(br#"{"model":"","prompt":"p","cache_salt":""}"#).unwrap();
    assert_eq!((r.model.as_str(), r.cache_salt), ("", None));
    assert!(matches!(
        parse_request(br#"{"model":"m","prompt":"p","cache_salt":5}"#),
        Err(ParseError::Malformed(_))
    ));
}

#[test]
fn non_text_parts_mark_the_request_multimodal() {
    let image = parse_request(
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
    )
    .unwrap();
    assert!(image.multimodal);
    let text = parse_request(
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look"}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}"#,
    )
    .unwrap();
    assert!(!text.multimodal);
}

#[test]
fn tenant_salt_replaces_the_clients_and_keeps_the_rest_verbatim() {
    let salt = tenant_salt("spiffe://cluster.local/ns/a/sa/app");
    assert!(
        salt.starts_with("kvroute-tenant-") && salt.len() == 31,
        "{salt}"
    );
    assert_ne!(salt, tenant_salt("spiffe://cluster.local/ns/b/sa/app"));
    assert_eq!(salt, tenant_salt("spiffe://cluster.local/ns/a/sa/app"));
    let body = br#"{"model":"m","cache_salt":"forged","seed":123456789012345678901234,"temperature":1e-5,"prompt":"caf\u00e9 \"q\""}"#;
    let salted = with_cache_salt(body, &salt).unwrap();
    let text = String::from_utf8(salted.clone()).unwrap();
    assert!(
        text.starts_with(&format!(r#"{{"cache_salt":"{salt}","#)),
        "{text}"
    );
    for verbatim in [
        r#""seed":123456789012345678901234"#,
        r#""temperature":1e-5"#,
        r#""prompt":"caf\u00e9 \"q\"""#,
    ] {
        assert!(text.contains(verbatim), "{verbatim} in {text}");
    }
    assert!(!text.contains("forged"));
    let parsed = parse_request(&salted).unwrap();
    assert_eq!(parsed.cache_salt, Some(salt));
    assert_eq!(
        parsed.prompt,
        Prompt::Text("café \"q\"".as_bytes().to_vec())
    );
    assert!(with_cache_salt(b"[1]", "s").is_err());
    assert!(with_cache_salt(b"{", "s").is_err());
}

#[test]
fn tokenizer_call_out_bodies() {
    let body = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let call: serde_json::Value =
        serde_json::from_slice(&tokenize_call_body(body).unwrap()).unwrap();
    assert_eq!(
        call,
        serde_json::json!({"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true})
    );
    let completion: serde_json::Value = serde_json::from_slice(
        &tokenize_call_body(br#"{"model":"m","prompt":"p","max_tokens":3}"#).unwrap(),
    )
    .unwrap();
    assert_eq!(completion, serde_json::json!({"model":"m","prompt":"p"}));
    assert!(tokenize_call_body(br#"{"model":"m","prompt":[1,2]}"#).is_none());
    let unnamed: serde_json::Value =
        serde_json::from_slice(&tokenize_call_body(br#"{"prompt":"p"}"#).unwrap()).unwrap();
    assert_eq!(unnamed, serde_json::json!({"prompt":"p"}));
    assert_eq!(
        parse_tokenize_response(br#"{"count":2,"max_model_len":9,"tokens":[5,6]}"#).unwrap(),
        vec![5, 6]
    );
    assert!(parse_tokenize_response(br#"{"error":"x"}"#).is_err());
}

/// serde's reading of a `/tokenize` answer, which the scanner must equal.
/// An answer is an object: serde would also read the struct from an
/// array (`[[5]]` as `tokens: [5]`), which no `/tokenize` answer is.
fn tokenize_answer_by_serde(body: &[u8]) -> Option<Vec<u32>> {
    #[derive(Deserialize)]
    struct Tokenized {
        tokens: Vec<u32>,
    }
    if body.iter().find(|b| !b" \t\n\r".contains(b)) != Some(&b'{') {
        return None;
    }
    serde_json::from_slice::<Tokenized>(body)
        .ok()
        .map(|t| t.tokens)
}

#[test]
fn tokenize_answers_read_as_serde_reads_them() {
    let answers: [&[u8]; 28] = [
        br#"{"count":2,"max_model_len":9,"tokens":[5,6],"token_strs":null}"#,
        b" {\n \"tokens\" : [ 0 ,\t4294967295 ] ,\r\"x\":{\"tokens\":[1]} } \n",
        br#"{"tokens":[]}"#,
        br#"{"token_strs":["a","\"]"],"tokens":[7]}"#,
        br#"{"t\u006fkens":[3]}"#,
        br#"{"tokens":[1],"tokens":[2]}"#,
        br#"{"tokens":[-1]}"#,
        br#"{"tokens":[1.0]}"#,
        br#"{"tokens":[1e3]}"#,
        br#"{"tokens":[1E3]}"#,
        br#"{"tokens":[4294967296]}"#,
        br#"{"tokens":[01]}"#,
        br#"{"tokens":["1"]}"#,
        br#"{"tokens":null}"#,
        br#"{"tokens":[1,]}"#,
        br#"{"tokens":[1] "#,
        br#"{"tokens":[1]}x"#,
        br#"{"tokens":[1]},"#,
        br#"{"tokens":[1],}"#,
        br#"{,"tokens":[1]}"#,
        br#"{"count":1}"#,
        br#"{"count":01,"tokens":[1]}"#,
        br#"{"x":[1,{"y":[}],"tokens":[1]}"#,
        br#"{tokens:[1]}"#,
        br#"[1,2]"#,
        br#"[[5,6]]"#,
        br#"[[]]"#,
        b"",
    ];
    for answer in answers {
        assert_eq!(
            parse_tokenize_response(answer).ok(),
            tokenize_answer_by_serde(answer),
            "{}",
            String::from_utf8_lossy(answer)
        );
    }
    assert_eq!(
        parse_tokenize_response(answers[0]).unwrap(),
        vec![5, 6],
        "and it reads something"
    );
}

#[test]
fn ids_of_every_length_read_as_serde_reads_them() {
    let mut ids: Vec<u64> = vec![0, u64::from(u32::MAX), u64::from(u32::MAX) + 1];
    let mut power = 1u64;
    for _ in 0..11 {
        ids.extend([power.saturating_sub(1), power, power + 7, 3 * power + 1]);
        power *= 10;
    }
    for id in ids {
        for spacing in ["", " ", "\n\t"] {
            let answer = format!(r#"{{"tokens":[{id}{spacing},7],"count":2}}"#);
            assert_eq!(
                parse_tokenize_response(answer.as_bytes()).ok(),
                tokenize_answer_by_serde(answer.as_bytes()),
                "{answer}"
            );
        }
    }
}

/// Flipped, dropped and duplicated bytes of valid answers read as serde
/// reads them (the cargo-fuzz target `request_parse` explores further).
#[test]
fn mutated_tokenize_answers_read_as_serde_reads_them() {
    let seeds: [&[u8]; 3] = [
        br#"{"count":3,"max_model_len":40960,"tokens":[151644, 8948,0],"token_strs":null}"#,
        b"{ \"token_strs\" : [\"a\\u00e9\", \"b\"],\n\"tokens\":[ 12 , 4294967295 ] }",
        br#"{"tokens":[1,2,3],"extra":{"deep":[1.5e3,-2,true,"x"]}}"#,
    ];
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    let mut read = 0;
    for _ in 0..50_000 {
        let mut body = seeds[(next() % seeds.len() as u64) as usize].to_vec();
        for _ in 0..1 + next() % 3 {
            let i = (next() % body.len() as u64) as usize;
            match next() % 3 {
                0 => body[i] = b"0123456789-+.eE,[]{}\" :x\x00\xff"[(next() % 23) as usize],
                1 => {
                    body.remove(i);
                }
                _ => body.insert(i, body[i]),
            }
            if body.is_empty() {
                break;
            }
        }
        let ours = parse_tokenize_response(&body).ok();
        read += usize::from(ours.is_some());
        assert_eq!(
            ours,
            tokenize_answer_by_serde(&body),
            "{}",
            String::from_utf8_lossy(&body)
        );
    }
    assert!(read > 1000, "only {read} mutants were answers");
}

/// Deterministic mutation fuzzing (runs in every `cargo test`; the cargo-fuzz
/// target explores further): flipped, dropped and duplicated bytes of valid
/// bodies give a prompt or a typed error, never a panic.
#[test]
fn mutated_bodies_never_panic() {
    let seeds: [&[u8]; 4] = [
        br#"{"model":"m","messages":[{"role":"user","name":"a","content":[{"type":"text","text":"hi \u00e9"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        br#"{"model":"m","prompt":[[1,2,3],[4]],"stream":true}"#,
        br#"{"model":"m","prompt":"plain","prompt_token_ids":[5,6]}"#,
        br#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}"#,
    ];
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    for _ in 0..50_000 {
        let seed = seeds[(next() % seeds.len() as u64) as usize];
        let mut body = seed.to_vec();
        for _ in 0..1 + next() % 4 {
            let i = (next() % body.len() as u64) as usize;
            match next() % 3 {
                0 => body[i] = (next() >> 24) as u8,
                1 => {
                    body.remove(i);
                }
                _ => body.insert(i, body[i]),
            }
            if body.is_empty() {
                break;
            }
        }
        // Whatever the object walk accepts is JSON.
        if parse_request(&body).is_ok() {
            assert!(
                serde_json::from_slice::<IgnoredAny>(&body).is_ok(),
                "{:?}",
                String::from_utf8_lossy(&body)
            );
        }
        let _ = tokenize_call_body(&body);
    }
}

#[test]
fn fields_are_read_in_any_order_and_once() {
    let r = parse_request(br#"{"prompt":[7, 8,9 ],"model":"m","cache_salt":"s","n":1}"#).unwrap();
    assert_eq!(r.model, "m");
    assert_eq!(r.prompt, Prompt::Tokens(vec![7, 8, 9]));
    assert_eq!(r.cache_salt.as_deref(), Some("s"));
    // Token ids given last still win, past values holding braces and quotes.
    let r =
        parse_request(br#"{"prompt":"p","x":[1,{"y":"}\"]"}],"prompt_token_ids":[3],"model":"m"}"#)
            .unwrap();
    assert_eq!(r.prompt, Prompt::Tokens(vec![3]));
    // An escaped key names its field.
    let r = parse_request(br#"{"pr\u006fmpt":[4]}"#).unwrap();
    assert_eq!(r.prompt, Prompt::Tokens(vec![4]));
    for bad in [
        r#"{"model":"a","prompt":"p","model":"b"}"#,
        r#"{"prompt":[1],"prompt":[2]}"#,
        r#"{"prompt":null,"prompt":"p"}"#,
        r#"{"prompt":[1,2]"#,
        r#"{"prompt":[1,2]}x"#,
        r#"{"prompt":[1,2],}"#,
        r#"{"prompt" [1]}"#,
        r#"{prompt:[1]}"#,
        r#"{"prompt":[1,2] "model":"m"}"#,
    ] {
        assert!(
            matches!(parse_request(bad.as_bytes()), Err(ParseError::Malformed(_))),
            "{bad}"
        );
    }
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    let ignored = format!(r#"{{"model":"m","x":{deep},"prompt":"p"}}"#);
    assert_eq!(
        parse_request(ignored.as_bytes()).unwrap().prompt,
        Prompt::Text(b"p".to_vec())
    );
    let in_prompt = format!(r#"{{"model":"m","prompt":{deep}}}"#);
    assert!(matches!(
        parse_request(in_prompt.as_bytes()),
        Err(ParseError::Malformed(_))
    ));
}
