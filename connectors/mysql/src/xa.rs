//! XA transaction ids as the binlog carries them.
//!
//! # Where an XA transaction shows up
//!
//! ```text
//!  MariaDB  GTID(flags PREPARED_XA, xid) · rows… · QUERY "XA END …" · XA_PREPARE(xid)
//!           GTID(flags COMPLETED_XA, xid) · QUERY "XA COMMIT X'…',X'…',n"    (or XA ROLLBACK)
//!  MySQL    GTID · QUERY "XA START X'…',X'…',n" · rows… · QUERY "XA END …" · XA_PREPARE(xid)
//!           GTID · QUERY "XA COMMIT X'…',X'…',n"                              (or XA ROLLBACK)
//!  either   XA COMMIT … ONE PHASE: an ordinary transaction
//! ```
//!
//! The prepare and the outcome are two transactions of the binlog, each with its own GTID;
//! they are matched by the XID, which is the same bytes in every form above.

use std::fmt;

/// An XA transaction id: format id, global transaction id and branch qualifier.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Xid {
    pub format_id: u32,
    pub gtrid: Vec<u8>,
    pub bqual: Vec<u8>,
}

impl fmt::Display for Xid {
    /// The form the servers print: `X'7831',X'',1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "X'{}',X'{}',{}", hex(&self.gtrid), hex(&self.bqual), self.format_id)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

impl Xid {
    /// Reads `format_id u32 · gtrid_len u8 · bqual_len u8 · data`, the tail of a MariaDB GTID
    /// event flagged PREPARED_XA or COMPLETED_XA.
    pub fn from_gtid_event(data: &[u8]) -> Option<Self> {
        let format_id = u32::from_le_bytes(data.get(0..4)?.try_into().ok()?);
        let (g, b) = (usize::from(*data.get(4)?), usize::from(*data.get(5)?));
        let body = data.get(6..6 + g + b)?;
        Some(Self { format_id, gtrid: body[..g].to_vec(), bqual: body[g..].to_vec() })
    }

    /// Reads an XA_PREPARE event body: `one_phase u8 · format_id u32 · gtrid_len u32 ·
    /// bqual_len u32 · data` (the same on both servers).
    pub fn from_prepare_event(data: &[u8]) -> Option<Self> {
        let int = |at: usize| Some(u32::from_le_bytes(data.get(at..at + 4)?.try_into().ok()?));
        let format_id = int(1)?;
        let (g, b) = (int(5)? as usize, int(9)? as usize);
        if g > 64 || b > 64 {
            return None;
        }
        let body = data.get(13..13 + g + b)?;
        Some(Self { format_id, gtrid: body[..g].to_vec(), bqual: body[g..].to_vec() })
    }

    /// Reads the id from the text the servers log: `X'7831',X'',1` (bqual and format id may be
    /// left out, as in `XA COMMIT X'7831'`).
    pub fn from_text(text: &str) -> Option<Self> {
        let mut parts = text.trim().split(',').map(str::trim);
        let quoted = |p: &str| -> Option<Vec<u8>> {
            let inner = p.strip_prefix(['X', 'x'])?.strip_prefix('\'')?.strip_suffix('\'')?;
            unhex(inner)
        };
        let gtrid = quoted(parts.next()?)?;
        let bqual = match parts.next() {
            Some(p) => quoted(p)?,
            None => Vec::new(),
        };
        let format_id = match parts.next() {
            Some(p) => p.parse().ok()?,
            None => 1,
        };
        parts.next().is_none().then_some(Self { format_id, gtrid, bqual })
    }
}

/// What an XA statement in a QUERY event means for the transaction it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XaStatement {
    /// `XA START xid` (MySQL logs it; MariaDB puts the xid in the GTID event instead).
    Start(Xid),
    /// `XA END xid`: nothing for the reader.
    End,
    /// `XA COMMIT xid` or `XA ROLLBACK xid` of a prepared transaction.
    Outcome { xid: Xid, committed: bool },
    /// `XA COMMIT xid ONE PHASE`: the transaction commits like any other.
    OnePhaseCommit,
}

/// Recognises the XA statements the servers write to the binlog; `None` for any other text.
pub fn statement(query: &str) -> Option<XaStatement> {
    let q = query.trim();
    let upper = q.get(..q.len().min(12))?.to_ascii_uppercase();
    if !upper.starts_with("XA ") {
        return None;
    }
    let rest = q[3..].trim_start();
    let (word, tail) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
    match word.to_ascii_uppercase().as_str() {
        "START" | "BEGIN" => Xid::from_text(strip_suffix_words(tail, &["JOIN", "RESUME"])).map(XaStatement::Start),
        "END" => Some(XaStatement::End),
        "COMMIT" => {
            let upper_tail = tail.to_ascii_uppercase();
            if upper_tail.trim_end().ends_with("ONE PHASE") {
                Some(XaStatement::OnePhaseCommit)
            } else {
                Xid::from_text(tail).map(|xid| XaStatement::Outcome { xid, committed: true })
            }
        }
        "ROLLBACK" => Xid::from_text(tail).map(|xid| XaStatement::Outcome { xid, committed: false }),
        _ => None,
    }
}

fn strip_suffix_words<'a>(text: &'a str, words: &[&str]) -> &'a str {
    let trimmed = text.trim_end();
    for w in words {
        if trimmed.len() > w.len() && trimmed[trimmed.len() - w.len()..].eq_ignore_ascii_case(w) {
            return trimmed[..trimmed.len() - w.len()].trim_end();
        }
    }
    trimmed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_forms_agree() {
        // Recorded from MariaDB 10.11: XA START 'x1' (GTID event tail, XA_PREPARE body).
        let from_gtid = Xid::from_gtid_event(&[1, 0, 0, 0, 2, 0, b'x', b'1', 1, 0xff]).unwrap();
        let from_prepare = Xid::from_prepare_event(&[0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, b'x', b'1']).unwrap();
        let from_text = Xid::from_text("X'7831',X'',1").unwrap();
        assert_eq!(from_gtid, from_prepare);
        assert_eq!(from_gtid, from_text);
        assert_eq!(from_text.to_string(), "X'7831',X'',1");
        assert_eq!(Xid::from_text("x'7832' , X'6232' , 7").unwrap().bqual, b"b2");
        assert!(Xid::from_text("'x1'").is_none());
        assert!(Xid::from_prepare_event(&[0, 1, 0]).is_none());
    }

    #[test]
    fn statements() {
        let xid = Xid::from_text("X'7831',X'',1").unwrap();
        assert_eq!(statement("XA START X'7831',X'',1"), Some(XaStatement::Start(xid.clone())));
        assert_eq!(statement("XA END X'7831',X'',1"), Some(XaStatement::End));
        assert_eq!(
            statement("XA COMMIT X'7831',X'',1"),
            Some(XaStatement::Outcome { xid: xid.clone(), committed: true })
        );
        assert_eq!(statement("xa rollback X'7831',X'',1"), Some(XaStatement::Outcome { xid, committed: false }));
        assert_eq!(statement("XA COMMIT X'7831',X'',1 ONE PHASE"), Some(XaStatement::OnePhaseCommit));
        assert_eq!(statement("COMMIT"), None);
        assert_eq!(statement("XA"), None);
        assert_eq!(statement("INSERT INTO xa_log VALUES (1)"), None);
    }
}
