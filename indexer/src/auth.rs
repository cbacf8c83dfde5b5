//! Who may write learned entries (`POST /v1/learned`).
//!
//! A learned entry steers every proxy's routing, so writes need a bearer
//! token from `--learned-token-file` (one accepted token per non-empty line,
//! so a token can be rotated without a window where either side is refused).
//! The file is re-read when its modification time or size changes, which is
//! how a mounted Kubernetes Secret is updated. Without a token file, writes
//! are refused unless `--allow-unauthenticated-learned` says otherwise.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use subtle::ConstantTimeEq;

/// Shortest accepted token: a guessable token is no authentication.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Why a write was refused; `reason()` is the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No token is configured and unauthenticated writes are not allowed.
    WritesDisabled,
    /// No `authorization` header.
    MissingToken,
    /// An `authorization` header that is not `Bearer <token>`.
    MalformedAuthorization,
    /// A bearer token that matches no accepted token.
    WrongToken,
    /// The token file cannot be read (or holds no token) right now.
    TokenUnavailable,
}

impl Refusal {
    /// Label of `kvroute_indexer_learned_unauthorized_total`.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::WritesDisabled => "writes_disabled",
            Refusal::MissingToken => "missing_token",
            Refusal::MalformedAuthorization => "malformed_authorization",
            Refusal::WrongToken => "wrong_token",
            Refusal::TokenUnavailable => "token_unavailable",
        }
    }
}

/// Why the token file is unusable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenFileError {
    /// The file cannot be read.
    Unreadable(String),
    /// The file holds no token.
    Empty,
    /// A token shorter than [`MIN_TOKEN_BYTES`].
    TooShort { line: usize },
}

impl std::fmt::Display for TokenFileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenFileError::Unreadable(e) => write!(f, "unreadable: {e}"),
            TokenFileError::Empty => write!(f, "holds no token"),
            TokenFileError::TooShort { line } => write!(
                f,
                "line {line}: a token must have at least {MIN_TOKEN_BYTES} bytes"
            ),
        }
    }
}

/// What identifies one version of the token file.
type Stamp = (Option<SystemTime>, u64);

struct Loaded {
    stamp: Stamp,
    tokens: Result<Vec<Vec<u8>>, TokenFileError>,
}

/// Accepted tokens, read from a file and re-read when it changes.
pub struct TokenFile {
    path: PathBuf,
    loaded: Mutex<Option<Loaded>>,
}

impl TokenFile {
    /// Reads the file once; start-up refuses a file that gives no token.
    pub fn open(path: &Path) -> Result<TokenFile, TokenFileError> {
        let file = TokenFile {
            path: path.to_owned(),
            loaded: Mutex::new(None),
        };
        file.with_tokens(|tokens| tokens.map(|_| ()))?;
        Ok(file)
    }

    fn stamp(&self) -> Result<Stamp, TokenFileError> {
        let meta =
            std::fs::metadata(&self.path).map_err(|e| TokenFileError::Unreadable(e.to_string()))?;
        Ok((meta.modified().ok(), meta.len()))
    }

    fn read(&self) -> Result<Vec<Vec<u8>>, TokenFileError> {
        let text = std::fs::read_to_string(&self.path)
            .map_err(|e| TokenFileError::Unreadable(e.to_string()))?;
        let mut tokens = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let token = line.trim();
            if token.is_empty() {
                continue;
            }
            if token.len() < MIN_TOKEN_BYTES {
                return Err(TokenFileError::TooShort { line: i + 1 });
            }
            tokens.push(token.as_bytes().to_vec());
        }
        if tokens.is_empty() {
            return Err(TokenFileError::Empty);
        }
        Ok(tokens)
    }

    /// Runs `f` on the current tokens, re-reading the file first if it changed.
    fn with_tokens<T>(&self, f: impl FnOnce(Result<&[Vec<u8>], TokenFileError>) -> T) -> T {
        let stamp = match self.stamp() {
            Ok(s) => s,
            Err(e) => return f(Err(e)),
        };
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if loaded.as_ref().is_none_or(|l| l.stamp != stamp) {
            let tokens = self.read();
            match &tokens {
                Ok(t) => eprintln!(
                    "kvroute-indexer: learned-writer tokens read from {} ({} accepted)",
                    self.path.display(),
                    t.len()
                ),
                Err(e) => eprintln!(
                    "kvroute-indexer: --learned-token-file {}: {e}; learned writes are refused",
                    self.path.display()
                ),
            }
            *loaded = Some(Loaded { stamp, tokens });
        }
        match loaded.as_ref().map(|l| &l.tokens) {
            Some(Ok(tokens)) => f(Ok(tokens)),
            Some(Err(e)) => f(Err(e.clone())),
            None => f(Err(TokenFileError::Empty)),
        }
    }
}

/// The write policy of `POST /v1/learned`.
pub enum WriteAccess {
    /// A bearer token from the file is required.
    Token(TokenFile),
    /// Anyone who reaches the port may write (`--allow-unauthenticated-learned`).
    Open,
    /// Nobody may write (no token configured: the default).
    Closed,
}

impl WriteAccess {
    /// Checks the `authorization` header of a write.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), Refusal> {
        let file = match self {
            WriteAccess::Open => return Ok(()),
            WriteAccess::Closed => return Err(Refusal::WritesDisabled),
            WriteAccess::Token(file) => file,
        };
        let presented = bearer_token(authorization.ok_or(Refusal::MissingToken)?)?;
        file.with_tokens(|tokens| {
            let tokens = tokens.map_err(|_| Refusal::TokenUnavailable)?;
            // Compare against every accepted token, so the time taken does
            // not tell which one (if any) was close.
            let matched = tokens
                .iter()
                .fold(subtle::Choice::from(0), |any, t| any | t.ct_eq(presented));
            if bool::from(matched) {
                Ok(())
            } else {
                Err(Refusal::WrongToken)
            }
        })
    }
}

/// The token of `Bearer <token>` (scheme case-insensitive, RFC 7235).
fn bearer_token(header: &[u8]) -> Result<&[u8], Refusal> {
    let (scheme, rest) = match header.iter().position(|&b| b == b' ') {
        Some(i) => header.split_at(i),
        None => return Err(Refusal::MalformedAuthorization),
    };
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return Err(Refusal::MalformedAuthorization);
    }
    let token = rest.trim_ascii();
    if token.is_empty() {
        return Err(Refusal::MalformedAuthorization);
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    fn token_file(text: &str) -> (tempdir::Dir, PathBuf) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("token");
        std::fs::write(&path, text).expect("write token");
        (dir, path)
    }

    /// A directory removed at drop (std only).
    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "kvroute-auth-test-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).expect("temp dir");
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn header(s: &str) -> Option<&[u8]> {
        Some(s.as_bytes())
    }

    #[test]
    fn right_token_passes_anything_else_is_refused() {
        let (_dir, path) = token_file(&format!("{TOKEN}\n"));
        let access = WriteAccess::Token(TokenFile::open(&path).expect("token file"));
        assert_eq!(access.check(header(&format!("Bearer {TOKEN}"))), Ok(()));
        assert_eq!(access.check(header(&format!("bearer  {TOKEN} "))), Ok(()));
        assert_eq!(access.check(None), Err(Refusal::MissingToken));
        assert_eq!(
            access.check(header(&format!("Basic {TOKEN}"))),
            Err(Refusal::MalformedAuthorization)
        );
        assert_eq!(
            access.check(header("Bearer ")),
            Err(Refusal::MalformedAuthorization)
        );
        assert_eq!(
            access.check(header(TOKEN)),
            Err(Refusal::MalformedAuthorization)
        );
        assert_eq!(
            access.check(header(&format!("Bearer {TOKEN}x"))),
            Err(Refusal::WrongToken)
        );
        assert_eq!(
            access.check(header(&format!("Bearer {}", &TOKEN[1..]))),
            Err(Refusal::WrongToken)
        );
        assert_eq!(
            access.check(header("Bearer fedcba9876543210fedcba9876543210")),
            Err(Refusal::WrongToken)
        );
    }

    #[test]
    fn open_and_closed() {
        assert_eq!(WriteAccess::Open.check(None), Ok(()));
        assert_eq!(
            WriteAccess::Closed.check(header(&format!("Bearer {TOKEN}"))),
            Err(Refusal::WritesDisabled)
        );
    }

    #[test]
    fn every_line_is_a_token_and_changes_are_picked_up() {
        let old = "old-token-0123456789";
        let new = "new-token-0123456789";
        let (_dir, path) = token_file(&format!("{old}\n\n  {new}  \n"));
        let access = WriteAccess::Token(TokenFile::open(&path).expect("token file"));
        assert_eq!(access.check(header(&format!("Bearer {old}"))), Ok(()));
        assert_eq!(access.check(header(&format!("Bearer {new}"))), Ok(()));
        // Rotation done: the old token goes (a different size, so a new stamp
        // even on a coarse-grained clock).
        std::fs::write(&path, format!("{new}\n")).expect("rewrite");
        assert_eq!(
            access.check(header(&format!("Bearer {old}"))),
            Err(Refusal::WrongToken)
        );
        assert_eq!(access.check(header(&format!("Bearer {new}"))), Ok(()));
        // A file that goes away refuses every write until it is back.
        std::fs::remove_file(&path).expect("remove");
        assert_eq!(
            access.check(header(&format!("Bearer {new}"))),
            Err(Refusal::TokenUnavailable)
        );
        std::fs::write(&path, format!("{new}\n")).expect("restore");
        assert_eq!(access.check(header(&format!("Bearer {new}"))), Ok(()));
    }

    #[test]
    fn unusable_files_are_refused_at_start() {
        let (_dir, path) = token_file("\n  \n");
        assert_eq!(TokenFile::open(&path).err(), Some(TokenFileError::Empty));
        let (_dir, path) = token_file("short\n");
        assert_eq!(
            TokenFile::open(&path).err(),
            Some(TokenFileError::TooShort { line: 1 })
        );
        assert!(matches!(
            TokenFile::open(Path::new("/nonexistent/kvroute/token")),
            Err(TokenFileError::Unreadable(_))
        ));
    }
}
