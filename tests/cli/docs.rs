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

/// The source files under `dir` (recursively) whose name ends in one of `extensions`.
fn sources(dir: &Path, extensions: &[&str], found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() && !name.starts_with('.') && name != "target" {
            sources(&path, extensions, found);
        } else if extensions.iter().any(|extension| name.ends_with(extension)) {
            found.push(path);
        }
    }
}

#[test]
fn code_comments_cite_the_design_document_not_a_brief_outside_the_repository() {
    let root = Path::new(ROOT);
    let mut files = Vec::new();
    for dir in ["src", "ipc", "tools", "tests", "python", "benches", "scripts"] {
        sources(&root.join(dir), &[".rs", ".py", ".pyi", ".sh"], &mut files);
    }
    assert!(files.len() > 100, "the walk found the sources: {}", files.len());
    for file in files.iter().filter(|file| !file.ends_with("tests/cli/docs.rs")) {
        let text = std::fs::read_to_string(file).unwrap();
        for cited in
            ["SPEC section", "SPEC invariant", "SPEC 1", "SPEC 5", "SPEC 7", "SPEC's", "../shared"]
        {
            assert!(!text.contains(cited), "{} cites {cited:?}", file.display());
        }
    }
}
