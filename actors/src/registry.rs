//! A node-scoped registry of named actors. Each node (a process, or a simulated node inside one
//! process) has its own; nothing here is process-global, so two nodes in one process never see
//! each other's names. Names are kept in a `BTreeMap`, so listing them is ordered and
//! deterministic.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::actor::ActorRef;
use crate::error::{ActorError, Result};

/// Named actor references of one node; cheap to clone (clones share the table).
#[derive(Clone, Default)]
pub struct Registry {
    node: Arc<str>,
    names: Arc<Mutex<BTreeMap<String, Box<dyn Any + Send + Sync>>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("node", &self.node).field("names", &self.names()).finish()
    }
}

impl Registry {
    /// An empty registry of the node called `node`.
    pub fn new(node: impl Into<String>) -> Registry {
        let node: String = node.into();
        Registry { node: node.into(), names: Arc::default() }
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Registers `actor` under its name, replacing an earlier actor of that name.
    pub fn register<M: Send + 'static>(&self, actor: ActorRef<M>) {
        let name = actor.name().to_string();
        self.names.lock().unwrap_or_else(PoisonError::into_inner).insert(name, Box::new(actor));
    }

    /// The actor registered as `name` if it takes messages of type `M` and is still running.
    pub fn lookup<M: Send + 'static>(&self, name: &str) -> Result<ActorRef<M>> {
        let names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        names
            .get(name)
            .and_then(|any| any.downcast_ref::<ActorRef<M>>())
            .filter(|r| !r.is_closed())
            .cloned()
            .ok_or_else(|| ActorError::NotRegistered { name: name.to_string() })
    }

    /// Removes `name`.
    pub fn unregister(&self, name: &str) {
        self.names.lock().unwrap_or_else(PoisonError::into_inner).remove(name);
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.names.lock().unwrap_or_else(PoisonError::into_inner).keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::{spawn, Actor, Context};

    struct Echo;
    impl Actor for Echo {
        type Msg = u32;
        async fn handle(&mut self, _msg: u32, _ctx: &mut Context<u32>) -> Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn registries_of_two_nodes_do_not_share_names() {
        let (a, b) = (Registry::new("node-a"), Registry::new("node-b"));
        let (echo, _h) = spawn("echo", Echo, 1);
        a.register(echo);
        assert!(a.lookup::<u32>("echo").is_ok());
        assert!(matches!(b.lookup::<u32>("echo"), Err(ActorError::NotRegistered { .. })));
        // The wrong message type is not a match either.
        assert!(a.lookup::<String>("echo").is_err());
        assert_eq!(a.names(), vec!["echo".to_string()]);
    }
}
