use std::hint::black_box;
use std::time::Instant;
fn time(name: &str, mut f: impl FnMut() -> usize) {
    for _ in 0..200 { black_box(f()); }
    let mut v: Vec<f64> = (0..2000).map(|_| { let t = Instant::now(); black_box(f()); t.elapsed().as_secs_f64() * 1e6 }).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("{name:40} p50 {:7.2} us", v[v.len() / 2]);
}
fn main() {
    let ids: Vec<String> = (0..8192u32).map(|t| (t.wrapping_mul(2_654_435_761) % 150_000).to_string()).collect();
    let b = format!(r#"{{"model":"Qwen/Qwen3-32B","max_tokens":1,"prompt":[{}]}}"#, ids.join(",")).into_bytes();
    println!("body {} bytes", b.len());
    time("parse_request", || match kvroute_core::request::parse_request(&b).unwrap().prompt { kvroute_core::request::Prompt::Tokens(t) => t.len(), _ => 0 });
    time("IgnoredAny", || { let _: serde::de::IgnoredAny = serde_json::from_slice(&b).unwrap(); 1 });
    #[derive(serde::Deserialize)] struct R<'a> { #[serde(borrow)] prompt: &'a serde_json::value::RawValue }
    time("RawValue prompt", || { let r: R = serde_json::from_slice(&b).unwrap(); r.prompt.get().len() });
    #[derive(serde::Deserialize)] struct V { prompt: Vec<u32> }
    time("Vec<u32> prompt", || { let r: V = serde_json::from_slice(&b).unwrap(); r.prompt.len() });
}
