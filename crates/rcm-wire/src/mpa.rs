//! iWARP MPA (placeholder while being written).
