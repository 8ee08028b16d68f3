//! The `hosts.toml` merge and cleanup, as pure text transformations: Ferry's entry is a marked
//! block inserted where toml_edit finds the first host. Invariant: the operator's bytes are never
//! rewritten, and cleanup removes exactly the bytes that were inserted.

use toml_edit::Document;

/// Cleanup finds Ferry's block by this line and [`BLOCK_END`].
pub const BLOCK_BEGIN: &str = "# >>> ferry mirror: added by ferry, removed by `ferry cleanup`";
pub const BLOCK_END: &str = "# <<< ferry mirror";
/// First line of a file Ferry created in a directory that already existed.
pub const CREATED_FILE: &str =
    "# ferry: this file was created by ferry; `ferry cleanup` deletes it";
/// First line of a file Ferry created together with its directory.
pub const CREATED_DIR: &str =
    "# ferry: this file and its directory were created by ferry; `ferry cleanup` deletes both";

/// How a host whose URL holds an IPv6 address is written: containerd 1.x drops a file with `]`
/// in a table header, 2.x ignores dotted keys (docs/design/how-it-works.md). `Dotted` is the
/// default because it never breaks a pull; `Tables` once containerd says it is 2.x.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Ipv6Hosts {
    #[default]
    Dotted,
    Tables,
}

impl Ipv6Hosts {
    pub fn for_containerd(major: u32) -> Self {
        if major >= 2 {
            Ipv6Hosts::Tables
        } else {
            Ipv6Hosts::Dotted
        }
    }
}

/// A mirror serves pulls and resolves tags, never pushes.
const CAPABILITIES: &str = r#"["pull", "resolve"]"#;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MergeError {
    #[error("not valid TOML ({0}); left untouched")]
    Unparseable(String),
    #[error(
        "`host` is not written as [host.\"...\"] tables, so ferry cannot place its entry first; left untouched"
    )]
    UnsupportedLayout,
    #[error("the merged file did not check out ({0}); left untouched")]
    Verification(String),
    #[error(
        "ferry's marker lines were edited (half a block, or two); left untouched: fix or remove them by hand"
    )]
    BrokenMarkers,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Merged {
    /// The file already says what Ferry wants.
    Unchanged,
    /// The operator lists this mirror URL themselves; their entry stands.
    OperatorEntry,
    Updated(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cleaned {
    /// Nothing of Ferry's in it.
    Untouched,
    /// The file's bytes from before Ferry.
    Restored(String),
    /// Ferry created the file (and the directory when `dir` is true): delete it.
    Delete { dir: bool },
    /// Ferry's markers were edited by hand; the file is left as it is.
    Broken(String),
}

/// The `server` for a registry host, as containerd would default it.
pub fn default_server(host: &str) -> String {
    match host {
        "docker.io" => "https://registry-1.docker.io".to_string(),
        _ => format!("https://{host}"),
    }
}

/// A new `hosts.toml`; `None` is `_default`, which has no `server`.
pub fn new_file(
    host: Option<&str>,
    mirror_url: &str,
    ipv6: Ipv6Hosts,
    created_dir: bool,
) -> String {
    let mut skeleton = String::new();
    skeleton.push_str(if created_dir {
        CREATED_DIR
    } else {
        CREATED_FILE
    });
    skeleton.push('\n');
    if let Some(host) = host {
        skeleton.push_str(&format!("server = \"{}\"\n", default_server(host)));
    }
    // A fresh skeleton cannot fail to merge; the fallback is what the merge would produce.
    match merge(&skeleton, mirror_url, ipv6) {
        Ok(Merged::Updated(text)) => text,
        _ => format!(
            "{skeleton}\n{}",
            block(mirror_url, dotted_url(mirror_url, ipv6), "\n")
        ),
    }
}

/// Ferry's block, with the file's own line ending so CRLF files stay CRLF.
fn block(mirror_url: &str, dotted: bool, eol: &str) -> String {
    if dotted {
        return format!(
            "{BLOCK_BEGIN}{eol}host.\"{mirror_url}\".capabilities = {CAPABILITIES}{eol}{BLOCK_END}{eol}"
        );
    }
    format!(
        "{BLOCK_BEGIN}{eol}[host.\"{mirror_url}\"]{eol}  capabilities = {CAPABILITIES}{eol}{BLOCK_END}{eol}"
    )
}

fn dotted_url(mirror_url: &str, ipv6: Ipv6Hosts) -> bool {
    mirror_url.contains('[') && ipv6 == Ipv6Hosts::Dotted
}

/// A dotted entry for an IPv6 URL on containerd 1.x, and when the operator already has dotted
/// hosts, since a table of Ferry's cannot come before a root key.
fn needs_dotted(doc: &Document<&str>, mirror_url: &str, ipv6: Ipv6Hosts) -> bool {
    let operator_dotted = doc.get("host").and_then(|h| h.as_table()).is_some_and(|h| {
        h.iter()
            .any(|(_, item)| item.as_table().is_some_and(|t| t.is_dotted()))
    });
    dotted_url(mirror_url, ipv6) || operator_dotted
}

/// Adds Ferry's mirror entry to `existing`, first among the host tables.
pub fn merge(existing: &str, mirror_url: &str, ipv6: Ipv6Hosts) -> Result<Merged, MergeError> {
    // An earlier block of ours (perhaps for another URL, or no longer first) is redone afresh.
    let base = remove_block(existing)?.unwrap_or_else(|| existing.to_string());
    let eol = if base.contains("\r\n") { "\r\n" } else { "\n" };
    let doc = Document::parse(base.as_str())
        .map_err(|e| MergeError::Unparseable(one_line(&e.to_string())))?;
    let hosts = host_tables(&doc)?;
    if hosts.iter().any(|(url, _)| url == mirror_url) {
        // The operator's own entry stands; ours (if any) goes.
        return Ok(if base == existing {
            Merged::OperatorEntry
        } else {
            Merged::Updated(base)
        });
    }
    // A dotted entry belongs with the root keys, before the first table of any kind.
    let first_table = |doc: &Document<&str>| {
        doc.iter()
            .filter_map(|(_, item)| match item {
                toml_edit::Item::Table(t) => earliest(t),
                toml_edit::Item::ArrayOfTables(a) => a.span().map(|s| s.start),
                _ => None,
            })
            .min()
    };
    let dotted = needs_dotted(&doc, mirror_url, ipv6);
    let first_host = hosts.iter().map(|(_, start)| *start).min();
    let place = if dotted {
        first_table(&doc).into_iter().chain(first_host).min()
    } else {
        first_host
    };
    let text = match place {
        Some(first) => {
            let at = attached_comment_start(&base, line_start(&base, first));
            format!(
                "{}{}{eol}{}",
                &base[..at],
                block(mirror_url, dotted, eol),
                &base[at..]
            )
        }
        None if base.is_empty() => block(mirror_url, dotted, eol),
        // Appended after exactly one "\n" of ours, which `cleanup` removes again.
        None => format!("{base}{eol}{}", block(mirror_url, dotted, eol)),
    };
    verify(&text, mirror_url)?;
    if text == existing {
        Ok(Merged::Unchanged)
    } else {
        Ok(Merged::Updated(text))
    }
}

/// Removes Ferry's block, or says to delete a file Ferry created.
pub fn cleanup(text: &str) -> Cleaned {
    let rest = match remove_block(text) {
        Ok(Some(rest)) => rest,
        Ok(None) => {
            return created_marker(text).map_or(Cleaned::Untouched, |dir| Cleaned::Delete { dir });
        }
        Err(e) => return Cleaned::Broken(e.to_string()),
    };
    match created_marker(&rest) {
        Some(dir) if is_skeleton(&rest) => Cleaned::Delete { dir },
        _ => Cleaned::Restored(rest),
    }
}

/// None, or exactly one BEGIN before one END; anything else was edited by hand.
fn block_lines(text: &str) -> Result<Option<(usize, usize)>, MergeError> {
    let all = |marker| {
        let mut found = Vec::new();
        let mut from = 0;
        while let Some(at) = find_line(text, marker, from) {
            found.push(at);
            from = line_end(text, at);
        }
        found
    };
    match (all(BLOCK_BEGIN).as_slice(), all(BLOCK_END).as_slice()) {
        ([], []) => Ok(None),
        ([begin], [end]) if begin < end => Ok(Some((*begin, *end))),
        _ => Err(MergeError::BrokenMarkers),
    }
}

/// The text without Ferry's block and the line break added with it.
fn remove_block(text: &str) -> Result<Option<String>, MergeError> {
    let Some((begin, end_line)) = block_lines(text)? else {
        return Ok(None);
    };
    let mut end = line_end(text, end_line);
    let mut start = begin;
    if end < text.len() {
        // Inserted before the operator's host tables, followed by one blank line of ours.
        if text[end..].starts_with("\r\n") {
            end += 2;
        } else if text[end..].starts_with('\n') {
            end += 1;
        }
    } else if text[..start].ends_with("\r\n") {
        // Appended at the end, after one line break of ours.
        start -= 2;
    } else if text[..start].ends_with('\n') {
        start -= 1;
    }
    Ok(Some(format!("{}{}", &text[..start], &text[end..])))
}

fn created_marker(text: &str) -> Option<bool> {
    match text.lines().next() {
        Some(CREATED_FILE) => Some(false),
        Some(CREATED_DIR) => Some(true),
        _ => None,
    }
}

/// A created file that still holds only what Ferry wrote (marker and `server`).
fn is_skeleton(text: &str) -> bool {
    text.lines()
        .skip(1)
        .all(|l| l.trim().is_empty() || l.starts_with("server = \"https://"))
}

/// `(url, byte offset where it first appears)` for every host, tables and dotted keys alike.
fn host_tables(doc: &Document<&str>) -> Result<Vec<(String, usize)>, MergeError> {
    let Some(host) = doc.get("host") else {
        return Ok(Vec::new());
    };
    let table = host.as_table().ok_or(MergeError::UnsupportedLayout)?;
    // `[host]` itself, or `host = { ... }`: no order containerd keeps.
    if !table.is_implicit() && !table.is_dotted() {
        return Err(MergeError::UnsupportedLayout);
    }
    table
        .iter()
        .map(|(url, item)| {
            let t = item.as_table().ok_or(MergeError::UnsupportedLayout)?;
            let start = if t.is_dotted() {
                let key = table.key(url).and_then(|k| k.span());
                let nested = earliest(t);
                key.map(|k| k.start).into_iter().chain(nested).min()
            } else {
                // A sub-table (`[host."x".header]`) may come before `[host."x"]`.
                earliest(t)
            };
            let start = start.ok_or(MergeError::UnsupportedLayout)?;
            Ok((url.to_string(), start))
        })
        .collect()
}

fn earliest(table: &toml_edit::Table) -> Option<usize> {
    let own = table.span().map(|s| s.start);
    let nested = table.iter().filter_map(|(_, item)| match item {
        toml_edit::Item::Table(t) => earliest(t),
        toml_edit::Item::ArrayOfTables(a) => a.span().map(|s| s.start),
        _ => None,
    });
    own.into_iter().chain(nested).min()
}

/// Checks that Ferry's entry is first in file order, the order containerd tries hosts in.
fn verify(text: &str, mirror_url: &str) -> Result<(), MergeError> {
    let doc =
        Document::parse(text).map_err(|e| MergeError::Verification(one_line(&e.to_string())))?;
    let hosts = host_tables(&doc).map_err(|e| MergeError::Verification(e.to_string()))?;
    let first = hosts.iter().min_by_key(|(_, start)| *start);
    if first.map(|(url, _)| url.as_str()) != Some(mirror_url) {
        return Err(MergeError::Verification(
            "ferry's entry is not the first host".into(),
        ));
    }
    let caps = doc["host"][mirror_url]["capabilities"]
        .as_array()
        .map(|a| a.len());
    if caps != Some(2) {
        return Err(MergeError::Verification(
            "ferry's entry lost its capabilities".into(),
        ));
    }
    Ok(())
}

fn line_start(text: &str, offset: usize) -> usize {
    text[..offset].rfind('\n').map_or(0, |i| i + 1)
}

fn line_end(text: &str, start: usize) -> usize {
    text[start..]
        .find('\n')
        .map_or(text.len(), |i| start + i + 1)
}

/// Comment lines directly above a table header belong to it: insert above them.
fn attached_comment_start(text: &str, mut at: usize) -> usize {
    while at > 0 {
        let prev = line_start(text, at - 1);
        if !text[prev..at].trim_start().starts_with('#') {
            break;
        }
        at = prev;
    }
    at
}

fn find_line(text: &str, line: &str, from: usize) -> Option<usize> {
    let mut at = from;
    while at < text.len() {
        let end = line_end(text, at);
        if text[at..end].trim_end_matches(['\n', '\r']) == line {
            return Some(at);
        }
        at = end;
    }
    None
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The API roots containerd tries for a tag after Ferry's entry, in its order: the resolving
/// hosts, then `server`; built as containerd's `parseHostConfig` does.
pub fn upstreams(
    text: &str,
    mirror_url: &str,
) -> Result<(Vec<String>, Option<String>), MergeError> {
    let doc =
        Document::parse(text).map_err(|e| MergeError::Unparseable(one_line(&e.to_string())))?;
    let mut hosts = host_tables(&doc)?;
    hosts.sort_by_key(|(_, start)| *start);
    let api_root = |url: &str, table: &dyn toml_edit::TableLike| {
        let override_path = table
            .get("override_path")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        api_root(url, override_path)
    };
    let resolves = |table: &dyn toml_edit::TableLike| match table.get("capabilities") {
        Some(caps) => caps.as_array().is_some_and(|a| {
            a.iter().any(|c| {
                c.as_str()
                    .is_some_and(|c| c.eq_ignore_ascii_case("resolve"))
            })
        }),
        // No capabilities: containerd grants pull, resolve and push.
        None => true,
    };
    let listed = hosts
        .iter()
        .filter(|(url, _)| url != mirror_url)
        .filter_map(|(url, _)| {
            let table = doc.get("host")?.get(url)?.as_table_like()?;
            resolves(table).then(|| api_root(url, table))
        })
        .collect();
    let server = doc
        .get("server")
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .map(|s| api_root(s, doc.as_table()));
    Ok((listed, server))
}

pub fn api_root(url: &str, override_path: bool) -> String {
    let url = if url.starts_with("http") {
        url.to_string()
    } else {
        format!("https://{url}")
    };
    let url = url.trim_end_matches('/');
    if override_path || url.ends_with("/v2") {
        return url.to_string();
    }
    format!("{url}/v2")
}

#[cfg(test)]
mod tests {
    use super::*;

    const V6_MIRROR: &str = "http://[fd00::5]:30480";

    fn merged(input: &str, mirror: &str) -> String {
        match merge(input, mirror, Ipv6Hosts::Dotted).unwrap() {
            Merged::Updated(text) => text,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_ipv6_mirror_is_a_dotted_key_before_every_table_and_comes_first() {
        let input = "server = \"https://registry.example\"\n\n[header]\n  x = \"1\"\n\n[host.\"https://cache.example\"]\n  capabilities = [\"pull\"]\n";
        let text = merged(input, V6_MIRROR);
        assert_eq!(
            text,
            format!(
                "server = \"https://registry.example\"\n\n{BLOCK_BEGIN}\nhost.\"{V6_MIRROR}\".capabilities = [\"pull\", \"resolve\"]\n{BLOCK_END}\n\n[header]\n  x = \"1\"\n\n[host.\"https://cache.example\"]\n  capabilities = [\"pull\"]\n"
            )
        );
        assert!(
            !text.contains("[host.\"http://["),
            "no table header holds a ']'"
        );
        assert_eq!(
            merge(&text, V6_MIRROR, Ipv6Hosts::Dotted).unwrap(),
            Merged::Unchanged
        );
        assert_eq!(cleanup(&text), Cleaned::Restored(input.to_string()));
        let (listed, server) = upstreams(&text, V6_MIRROR).unwrap();
        assert!(
            listed.is_empty(),
            "cache.example cannot resolve: {listed:?}"
        );
        assert_eq!(server.as_deref(), Some("https://registry.example/v2"));
    }

    #[test]
    fn an_operators_dotted_ipv6_host_is_kept_and_ferry_goes_before_it() {
        let input = "server = \"http://[fd00::1]:5000\"\nhost.\"http://[fd00::1]:5000\".capabilities = [\"pull\", \"resolve\"]\n";
        for mirror in ["http://127.0.0.1:5480", V6_MIRROR] {
            let text = merged(input, mirror);
            let doc = Document::parse(text.as_str()).unwrap();
            let mut hosts = host_tables(&doc).unwrap();
            hosts.sort_by_key(|(_, at)| *at);
            let order: Vec<&str> = hosts.iter().map(|(url, _)| url.as_str()).collect();
            assert_eq!(order, [mirror, "http://[fd00::1]:5000"], "{text}");
            assert_eq!(cleanup(&text), Cleaned::Restored(input.to_string()));
            let (listed, _) = upstreams(&text, mirror).unwrap();
            assert_eq!(listed, ["http://[fd00::1]:5000/v2"]);
        }
    }

    #[test]
    fn on_containerd_2_an_ipv6_mirror_is_a_table_as_any_other() {
        let input = "server = \"https://registry.example\"\n";
        let Merged::Updated(text) = merge(input, V6_MIRROR, Ipv6Hosts::Tables).unwrap() else {
            panic!()
        };
        assert!(text.contains(&format!("[host.\"{V6_MIRROR}\"]")), "{text}");
        verify(&text, V6_MIRROR).unwrap();
        // Learning containerd is 2.x rewrites a dotted entry as a table.
        let dotted = merged(input, V6_MIRROR);
        assert_eq!(
            merge(&dotted, V6_MIRROR, Ipv6Hosts::Tables).unwrap(),
            Merged::Updated(text)
        );
        assert_eq!(Ipv6Hosts::for_containerd(1), Ipv6Hosts::Dotted);
        assert_eq!(Ipv6Hosts::for_containerd(2), Ipv6Hosts::Tables);
    }

    #[test]
    fn a_new_file_for_an_ipv6_mirror_parses_with_ferry_first() {
        let text = new_file(Some("[fd00::1]:5000"), V6_MIRROR, Ipv6Hosts::Dotted, true);
        assert!(
            text.contains(&format!("host.\"{V6_MIRROR}\".capabilities")),
            "{text}"
        );
        verify(&text, V6_MIRROR).unwrap();
    }
}
