//! The repository documents itself: the README and `docs/` link only to files of the repository
//! (or to the web), never to a specification outside it, and the README links to the design
//! document. (The README's Rust example is compiled as a doctest of the kvshm crate.)

use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Every markdown file the repository's documentation consists of.
fn documents() -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    let mut documents = vec![root.join("README.md"), root.join("tools/kvctl/README.md")];
    for entry in std::fs::read_dir(root.join("docs")).expect("a docs/ directory") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|extension| extension == "md") {
            documents.push(path);
        }
    }
    documents
}

/// The targets of the inline links `[text](target)` of a markdown text.
fn link_targets(text: &str) -> Vec<String> {
    text.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &text[at + 2..];
            rest.find(')').map(|end| rest[..end].to_owned())
        })
        .collect()
}

#[test]
fn every_relative_link_of_the_documentation_points_into_the_repository() {
    let root = Path::new(ROOT).canonicalize().unwrap();
    for document in documents() {
        let text = std::fs::read_to_string(&document).unwrap();
        for target in link_targets(&text) {
            if target.starts_with("http://") || target.starts_with("https://") {
                continue;
            }
            let file = target.split('#').next().unwrap();
            if file.is_empty() {
                continue;
            }
            let path = document.parent().unwrap().join(file);
            let resolved = path.canonicalize().unwrap_or_else(|_| {
                panic!("{}: link to {target} leads nowhere", document.display())
            });
            assert!(
                resolved.starts_with(&root),
                "{}: link to {target} leaves the repository",
                document.display()
            );
        }
    }
}

#[test]
fn no_document_sends_readers_to_a_specification_outside_the_repository() {
    for document in documents() {
        let text = std::fs::read_to_string(&document).unwrap();
        assert!(!text.contains("SPEC.md"), "{} refers to SPEC.md", document.display());
    }
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    assert!(link_targets(&readme).iter().any(|target| target == "docs/DESIGN.md"));
}

#[test]
fn every_design_section_the_readme_links_to_exists() {
    let design = std::fs::read_to_string(Path::new(ROOT).join("docs/DESIGN.md")).unwrap();
    let anchors: Vec<String> = design
        .lines()
        .filter_map(|line| line.strip_prefix("## ").or_else(|| line.strip_prefix("### ")))
        .map(|title| {
            title
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect();
    for document in documents() {
        let text = std::fs::read_to_string(&document).unwrap();
        for target in link_targets(&text) {
            let Some((file, anchor)) = target.split_once('#') else { continue };
            if file.ends_with("DESIGN.md") || (file.is_empty() && document.ends_with("DESIGN.md")) {
                assert!(
                    anchors.iter().any(|known| known == anchor),
                    "{}: no section #{anchor} in docs/DESIGN.md",
                    document.display()
                );
            }
        }
    }
}
