//! Bearer tokens and what each may do: the topics (or RabbitMQ exchanges) and shards it may
//! prepare to, and the URL prefixes its check-back URLs must start with.

use crate::config::{ApiConfig, ConfigError};

/// One token, its secret read.
#[derive(Clone)]
pub(crate) struct Token {
    pub name: String,
    secret: Vec<u8>,
    topics: Vec<String>,
    /// `None`: every shard of the source.
    shards: Option<Vec<u32>>,
    checkback_urls: Vec<String>,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token").field("name", &self.name).finish_non_exhaustive()
    }
}

/// Every configured token.
#[derive(Debug, Clone)]
pub(crate) struct Tokens(Vec<Token>);

impl Tokens {
    /// Reads each token's secret; an unset variable, an unreadable file or a short secret is
    /// an error naming the token's setting. Two tokens with one secret are refused.
    pub(crate) fn load(api: &ApiConfig) -> Result<Self, ConfigError> {
        let mut tokens: Vec<Token> = Vec::new();
        for (i, t) in api.tokens.iter().enumerate() {
            let secret = t.secret(i)?.into_bytes();
            if let Some(twin) = tokens.iter().find(|o| o.secret == secret) {
                return Err(ConfigError::Invalid {
                    field: format!("api.token[{i}]"),
                    message: format!("has the same secret as token {:?}: give each token its own", twin.name),
                });
            }
            tokens.push(Token {
                name: t.name.clone(),
                secret,
                topics: t.topics.clone(),
                shards: t.shards.clone(),
                checkback_urls: t.checkback_urls.clone(),
            });
        }
        Ok(Self(tokens))
    }

    /// The secret of the token named `name`, for the check-back's calls to its service.
    pub(crate) fn secret_of(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|t| t.name == name).and_then(|t| std::str::from_utf8(&t.secret).ok())
    }

    /// The token whose secret `authorization` carries (`Bearer <secret>`). Every token's
    /// secret is compared in full, so the time taken says nothing about which bytes matched.
    pub(crate) fn authenticate(&self, authorization: Option<&[u8]>) -> Option<&Token> {
        let given = authorization?;
        let secret = given.strip_prefix(b"Bearer ").or_else(|| given.strip_prefix(b"bearer "))?;
        let mut found = None;
        for token in &self.0 {
            if same_bytes(&token.secret, secret) {
                found = Some(token);
            }
        }
        found
    }
}

/// Whether the part of a URL after its allowed prefix stays under that prefix.
fn stays_under_prefix(rest: &str) -> bool {
    let lower = rest.to_ascii_lowercase();
    !lower.contains("..")
        && !["%2e", "%2f", "%5c"].iter().any(|encoded| lower.contains(encoded))
        && !rest.contains(|c: char| c == '\\' || c.is_whitespace() || c.is_control())
}

/// Compares two byte strings in time that depends on their lengths only.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

impl Token {
    /// Whether this token may prepare to `topic`.
    pub(crate) fn allows_topic(&self, topic: &str) -> bool {
        self.topics.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => topic.starts_with(prefix),
            None => p == topic,
        })
    }

    /// Whether this token may prepare to `shard`.
    pub(crate) fn allows_shard(&self, shard: u32) -> bool {
        self.shards.as_ref().is_none_or(|s| s.contains(&shard))
    }

    /// Whether `url` starts with one of the token's check-back prefixes and its rest cannot
    /// lead out of it: no `..`, no encoded dot, slash or backslash, no backslash, no space.
    pub(crate) fn allows_checkback(&self, url: &str) -> bool {
        self.checkback_urls.iter().any(|p| url.strip_prefix(p.as_str()).is_some_and(stays_under_prefix))
    }

    #[cfg(test)]
    pub(crate) fn for_test(name: &str, topics: &[&str], shards: Option<Vec<u32>>, checkback: &[&str]) -> Self {
        Self {
            name: name.into(),
            secret: b"0123456789abcdef".to_vec(),
            topics: topics.iter().map(|t| t.to_string()).collect(),
            shards,
            checkback_urls: checkback.iter().map(|t| t.to_string()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> Tokens {
        let mut a = Token::for_test("a", &["orders", "pay.*"], Some(vec![0]), &[]);
        a.secret = b"secret-a-0123456789".to_vec();
        let mut b = Token::for_test("b", &["*"], None, &["https://b.internal/cb/"]);
        b.secret = b"secret-b-0123456789".to_vec();
        Tokens(vec![a, b])
    }

    #[test]
    fn a_bearer_secret_names_its_token_and_nothing_else_does() {
        let t = tokens();
        assert_eq!(t.authenticate(Some(b"Bearer secret-a-0123456789")).unwrap().name, "a");
        assert_eq!(t.authenticate(Some(b"Bearer secret-b-0123456789")).unwrap().name, "b");
        for bad in
            [&b"Bearer secret-a-012345678"[..], b"secret-a-0123456789", b"Basic secret-a-0123456789", b"Bearer ", b""]
        {
            assert!(t.authenticate(Some(bad)).is_none(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(t.authenticate(None).is_none());
    }

    #[test]
    fn short_and_shared_secrets_are_refused_naming_the_token() {
        let dir = std::env::temp_dir().join(format!("outbox-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let (long, other, short) =
            (file("long", "0123456789abcdef-one\n"), file("other", "0123456789abcdef-two"), file("short", "abc"));
        let load = |files: &[&str]| {
            let tokens: String = files
                .iter()
                .enumerate()
                .map(|(i, f)| format!("[[api.token]]\nname = \"t{i}\"\nsecret_file = \"{f}\"\ntopics = [\"*\"]\n"))
                .collect();
            let text = format!(
                "[[source]]\nname = \"app\"\nkind = \"postgres\"\nurl = \"postgres://u@h/d\"\n[api]\nlisten = \"127.0.0.1:1\"\nsource = \"app\"\n{tokens}"
            );
            let config = crate::config::Config::from_toml(&text).unwrap();
            Tokens::load(config.api.as_ref().unwrap()).map(|t| t.0.len()).map_err(|e| e.to_string())
        };
        assert_eq!(load(&[&long, &other]), Ok(2));
        let e = load(&[&long, &short]).unwrap_err();
        assert!(e.contains("api.token[1].secret_file") && e.contains("at least 16"), "{e}");
        let e = load(&[&long, &long]).unwrap_err();
        assert!(e.contains("api.token[1]") && e.contains("same secret as token \"t0\""), "{e}");
        assert!(!e.contains("0123456789abcdef"), "the secret is not shown: {e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn grants_limit_topics_shards_and_checkback_urls() {
        let t = tokens();
        let a = t.authenticate(Some(b"Bearer secret-a-0123456789")).unwrap();
        assert!(a.allows_topic("orders") && a.allows_topic("pay.eu") && a.allows_topic("pay."));
        assert!(!a.allows_topic("orders2") && !a.allows_topic("pay") && !a.allows_topic("other"));
        assert!(a.allows_shard(0) && !a.allows_shard(1));
        assert!(!a.allows_checkback("https://b.internal/cb/x"), "no prefix: no check-back URL");
        let b = t.authenticate(Some(b"Bearer secret-b-0123456789")).unwrap();
        assert!(b.allows_topic("anything") && b.allows_shard(7));
        assert!(b.allows_checkback("https://b.internal/cb/orders"));
        assert!(!b.allows_checkback("https://b.internal.evil/cb/") && !b.allows_checkback("https://b.internal/other"));
        for escape in [
            "https://b.internal/cb/../admin",
            "https://b.internal/cb/%2E%2e/admin",
            "https://b.internal/cb/x%2F..",
            "https://b.internal/cb/\\..\\x",
        ] {
            assert!(!b.allows_checkback(escape), "{escape}");
        }
    }
}
