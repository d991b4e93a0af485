//! Secrets that never print: passwords and URLs that may carry one.

use std::fmt;

use serde::{Deserialize, Deserializer};

/// A connection URL whose password is masked in `Debug` and `Display`.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct SecretUrl(String);

impl SecretUrl {
    #[cfg(test)]
    pub(crate) fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The real URL, for the driver only. Never log it.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with any password replaced by `***`.
    pub(crate) fn redacted(&self) -> String {
        redact_url(&self.0)
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl<'de> Deserialize<'de> for SecretUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(SecretUrl)
    }
}

/// Replaces the password of `scheme://user:password@host…` and of a `password=` parameter
/// (in a URL's query or a `key=value` connection string) with `***`.
///
/// Passwords are often written unencoded, so the userinfo ends at the *last* `@` of the
/// authority, and the authority runs to the first `/`, `?` or `#` after the first `@`: a raw
/// `@`, `/`, `?` or `#` in a password is masked with the rest of it.
pub(crate) fn redact_url(url: &str) -> String {
    let mut out = url.to_string();
    let is_url = out.contains("://");
    if let Some(scheme_end) = out.find("://") {
        let rest_start = scheme_end + 3;
        let rest = &out[rest_start..];
        if let Some(first_at) = rest.find('@') {
            let authority_end = rest[first_at..].find(['/', '?', '#']).map_or(rest.len(), |e| first_at + e);
            let at = rest[..authority_end].rfind('@').unwrap_or(first_at);
            if let Some(colon) = rest[..at].find(':') {
                out.replace_range(rest_start + colon + 1..rest_start + at, "***");
            }
        }
    }
    let mut from = 0;
    while let Some(p) = out[from..].find("password=").map(|p| from + p) {
        let start = p + "password=".len();
        let value = &out[start..];
        let len = if is_url {
            value.find(['&', '#']).unwrap_or(value.len())
        } else if let Some(quoted) = value.strip_prefix('\'') {
            // libpq quoting: 'it''s' or 'it\'s'; an unterminated quote runs to the end.
            let mut chars = quoted.char_indices();
            let mut end = quoted.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        chars.next();
                    }
                    '\'' => {
                        end = i + 1;
                        break;
                    }
                    _ => {}
                }
            }
            1 + end
        } else {
            value.find(char::is_whitespace).unwrap_or(value.len())
        };
        out.replace_range(start..start + len, "***");
        from = start + 3;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts() {
        assert_eq!(redact_url("postgres://u:s3cret@h:1/db"), "postgres://u:***@h:1/db");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact_url("host=h password=s3cret user=u"), "host=h password=*** user=u");
        let url = SecretUrl::new("mysql://a:b@c/d");
        assert!(!format!("{url:?} {url}").contains(":b@"));
    }

    /// A raw `@`, `/`, `?` or `#` in a password is still all masked, in both URL forms.
    #[test]
    fn redacts_passwords_with_separator_characters() {
        assert_eq!(redact_url("postgres://u:p@ss@h:1/db"), "postgres://u:***@h:1/db");
        assert_eq!(redact_url("postgres://u:p@s@s@h/db?sslmode=require"), "postgres://u:***@h/db?sslmode=require");
        assert_eq!(redact_url("postgres://u:p/ss@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact_url("mysql://u:p?s#s@h/db"), "mysql://u:***@h/db");
        assert_eq!(redact_url("postgres://u:pw@h/db?options=a@b"), "postgres://u:***@h/db?options=a@b");
        assert_eq!(redact_url("host=h password=p@ss&w user=u"), "host=h password=*** user=u");
        assert_eq!(
            redact_url("postgres://u@h/db?password=p@ss&sslmode=require"),
            "postgres://u@h/db?password=***&sslmode=require"
        );
        assert_eq!(redact_url("host=h password='p@s s' user=u"), "host=h password=*** user=u");
        assert_eq!(redact_url(r"host=h password='it\'s' user=u"), "host=h password=*** user=u");
        for url in ["postgres://u:p@zz@h/db", "host=h password=p@zz user=u", "postgres://u:p/zz@h/db"] {
            let shown = SecretUrl::new(url);
            assert!(!format!("{shown:?} {shown}").contains("zz"), "{shown}");
        }
    }
}
