use serde::Deserialize;
use std::borrow::Cow;
use std::hint::black_box;
use std::time::Instant;

#[derive(Deserialize)]
struct ReqS<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<MsgS<'a>>>,
}
#[derive(Deserialize)]
struct MsgS<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
}

struct BytesV;
impl<'de> serde::de::Visitor<'de> for BytesV {
    type Value = Cow<'de, [u8]>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result { f.write_str("s") }
    fn visit_borrowed_bytes<E>(self, v: &'de [u8]) -> Result<Self::Value, E> { Ok(Cow::Borrowed(v)) }
    fn visit_bytes<E>(self, v: &[u8]) -> Result<Self::Value, E> { Ok(Cow::Owned(v.to_vec())) }
    fn visit_byte_buf<E>(self, v: Vec<u8>) -> Result<Self::Value, E> { Ok(Cow::Owned(v)) }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> { Ok(Cow::Borrowed(v.as_bytes())) }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> { Ok(Cow::Owned(v.as_bytes().to_vec())) }
}
struct RawBytes<'a>(Cow<'a, [u8]>);
impl<'de: 'a, 'a> Deserialize<'de> for RawBytes<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_bytes(BytesV).map(RawBytes)
    }
}
#[derive(Deserialize)]
struct ReqB<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<MsgB<'a>>>,
}
#[derive(Deserialize)]
struct MsgB<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<RawBytes<'a>>,
}

fn body(size: usize, newline_every: usize) -> Vec<u8> {
    let mut filler = String::from("variant 0: ");
    let mut i = 0usize;
    while filler.len() < size - 200 {
        filler.push_str(&format!("w{} ", (i * 131) % 9973));
        i += 1;
        if newline_every > 0 && i % newline_every == 0 { filler.push_str("\\n"); }
    }
    format!(r#"{{"model":"Qwen/Qwen3-32B","max_tokens":1,"messages":[{{"role":"system","content":"{filler}"}},{{"role":"user","content":"question 0"}}]}}"#).into_bytes()
}

fn time(name: &str, mut f: impl FnMut() -> usize) {
    for _ in 0..200 { black_box(f()); }
    let mut v: Vec<f64> = (0..3000).map(|_| { let t = Instant::now(); black_box(f()); t.elapsed().as_secs_f64() * 1e6 }).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("{name:40} p50 {:6.2} us  p10 {:6.2}", v[v.len() / 2], v[v.len() / 10]);
}

fn main() {
    for nl in [0usize, 12] {
        let b = body(30 * 1024, nl);
        println!("body {} bytes, newline escape every {} words", b.len(), nl);
        time("str content (current)", || { let r: ReqS = serde_json::from_slice(&b).unwrap(); r.messages.unwrap().iter().map(|m| m.content.as_ref().map_or(0, |c| c.len()) + m.role.len()).sum::<usize>() + r.model.map_or(0, |m| m.len()) });
        time("bytes content", || { let r: ReqB = serde_json::from_slice(&b).unwrap(); r.messages.unwrap().iter().map(|m| m.content.as_ref().map_or(0, |c| c.0.len()) + m.role.len()).sum::<usize>() + r.model.map_or(0, |m| m.len()) });
        time("kvroute parse_request", || match kvroute_core::request::parse_request(&b).unwrap().prompt { kvroute_core::request::Prompt::Text(t) => t.len(), _ => 0 });
        time("from_utf8 alone", || std::str::from_utf8(black_box(&b)).unwrap().len());
        time("ignored (IgnoredAny)", || { let _: serde::de::IgnoredAny = serde_json::from_slice(&b).unwrap(); 1 });
    }
}
