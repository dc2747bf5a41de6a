//! The stored key is a function of the key's components, and an injective one: different
//! component sequences never give the same stored bytes, whether stored inline or hashed.

use idempotent_runtime::{KeyBuilder, MessageKey};
use proptest::prelude::*;

/// One key component, with integers normalized as the encoding widens them (`5u8` is `5i64`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Component {
    Str(String),
    Bytes(Vec<u8>),
    Int(i128),
    Uint(u128),
    Uuid(u128),
}

impl Component {
    fn normalized(&self) -> Component {
        match self {
            Component::Int(v) if *v >= 0 => Component::Uint(*v as u128),
            other => other.clone(),
        }
    }
}

fn component() -> impl Strategy<Value = Component> {
    prop_oneof![
        // Short strings over a small alphabet with NULs (collisions would show), and any Unicode.
        "[ab\\x00-\\x05]{1,8}".prop_map(Component::Str),
        any::<String>()
            .prop_filter("not empty", |s| !s.is_empty())
            .prop_map(Component::Str),
        proptest::collection::vec(0u8..3, 1..8).prop_map(Component::Bytes),
        proptest::collection::vec(any::<u8>(), 1..100).prop_map(Component::Bytes),
        any::<i128>().prop_map(Component::Int),
        (-3i128..3).prop_map(Component::Int),
        (0u128..3).prop_map(Component::Uint),
        any::<u128>().prop_map(Component::Uint),
        any::<u128>().prop_map(Component::Uuid),
    ]
}

fn key() -> impl Strategy<Value = Vec<Component>> {
    proptest::collection::vec(component(), 1..4)
}

fn stored(components: &[Component]) -> MessageKey {
    let mut builder = KeyBuilder::new();
    for component in components {
        match component {
            Component::Str(s) => builder.str(s),
            Component::Bytes(b) => builder.bytes(b),
            Component::Int(i) => builder.int(*i),
            Component::Uint(u) => builder.uint(*u),
            Component::Uuid(u) => builder.uuid(&uuid::Uuid::from_u128(*u)),
        }
    }
    builder.finish().expect("no empty components")
}

fn normalized(components: &[Component]) -> Vec<Component> {
    components.iter().map(Component::normalized).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn different_keys_are_stored_differently(a in key(), b in key()) {
        prop_assume!(normalized(&a) != normalized(&b));
        prop_assert_ne!(stored(&a), stored(&b));
    }

    #[test]
    fn a_key_is_stored_the_same_way_every_time(a in key()) {
        prop_assert_eq!(stored(&a), stored(&a.clone()));
        prop_assert_eq!(stored(&a), stored(&normalized(&a)));
    }

    #[test]
    fn stored_keys_are_short_and_hashed_ones_are_marked(a in key()) {
        let key = stored(&a);
        prop_assert!(key.as_bytes().len() <= 64);
        prop_assert_eq!(key.is_hashed(), key.as_bytes()[0] == 0xFF);
        if key.is_hashed() {
            prop_assert_eq!(key.as_bytes().len(), 33);
        }
    }

    /// Moving the boundary between two string components changes the key: the case a plain
    /// concatenation would get wrong, inline and hashed alike.
    #[test]
    fn component_boundaries_matter(s in "[a\\x00-\\x05]{2,120}", cut in 1usize..119) {
        let cut = cut.min(s.len() - 1);
        let whole = vec![Component::Str(s.clone())];
        let split = vec![Component::Str(s[..cut].to_owned()), Component::Str(s[cut..].to_owned())];
        prop_assert_ne!(stored(&whole), stored(&split));
    }
}

proptest! {
    /// A string that embeds what looks like the encoding of a second component (a string tag and a
    /// length) is still one component, different from the two-component key it imitates.
    #[test]
    fn an_embedded_encoding_does_not_forge_a_composite_key(
        s1 in "[a-z]{1,40}",
        s2 in "[a-z]{1,40}",
        claimed_len in prop_oneof![Just(None), (0u8..128).prop_map(Some)],
    ) {
        let len = claimed_len.unwrap_or(s2.len() as u8);
        let mut forged = s1.clone().into_bytes();
        forged.extend_from_slice(&[0x01, len]);
        forged.extend_from_slice(s2.as_bytes());
        let forged = String::from_utf8(forged).expect("ASCII");
        let composite = vec![Component::Str(s1), Component::Str(s2)];
        prop_assert_ne!(stored(&[Component::Str(forged)]), stored(&composite));
    }
}
