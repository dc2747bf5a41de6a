//! One trace across hops (feature `otel`): the W3C trace context (`traceparent`, `tracestate`)
//! of the span that queued an outgoing message travels in the message's headers, through the
//! outbox and the broker, and the runner that receives it makes its delivery span a child of that
//! span; the HTTP layer continues an incoming request's context the same way.
//!
//! Spans are `tracing` spans; their OpenTelemetry context is what `tracing-opentelemetry`'s layer
//! gives them, so nothing is carried unless the application installed that layer. Without the
//! feature, each function here does nothing.

/// The headers of the W3C trace context: the parent span, and vendors' state.
#[cfg(feature = "otel")]
const TRACEPARENT: &str = "traceparent";
#[cfg(feature = "otel")]
const TRACESTATE: &str = "tracestate";

/// Adds the current span's trace context to `headers` (`traceparent`, and `tracestate` if it has
/// one), unless they carry one of the two already (a context the caller chose).
pub(crate) fn inject_current(headers: &mut Vec<(String, String)>) {
    #[cfg(feature = "otel")]
    {
        use opentelemetry::propagation::TextMapPropagator;
        use tracing_opentelemetry::OpenTelemetrySpanExt;

        if headers.iter().any(|(name, _)| {
            name.eq_ignore_ascii_case(TRACEPARENT) || name.eq_ignore_ascii_case(TRACESTATE)
        }) {
            return;
        }
        let context = tracing::Span::current().context();
        let mut injected = Injected(headers);
        propagator().inject_context(&context, &mut injected);
    }
    #[cfg(not(feature = "otel"))]
    let _ = headers;
}

/// Makes `span` a child of the span whose trace context `header` finds (its `traceparent` and
/// `tracestate`), if it finds one that is valid; otherwise leaves it as it is.
pub(crate) fn continue_from<'h>(span: &tracing::Span, header: impl Fn(&str) -> Option<&'h str>) {
    #[cfg(feature = "otel")]
    {
        use opentelemetry::propagation::TextMapPropagator;
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;

        let context = propagator().extract(&Extracted::from(header));
        if context.span().span_context().is_valid() {
            // Only fails for a span that was entered already: a new span is not.
            let _ = span.set_parent(context);
        }
    }
    #[cfg(not(feature = "otel"))]
    let _ = (span, header);
}

/// Links `span` to the span whose trace context `header` finds, if it finds a valid one: a batch
/// of messages from several traces is a child of none of them, and linked to each.
#[cfg_attr(
    not(any(
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "sqs"
    )),
    allow(dead_code)
)]
pub(crate) fn link_from<'h>(span: &tracing::Span, header: impl Fn(&str) -> Option<&'h str>) {
    #[cfg(feature = "otel")]
    {
        use opentelemetry::propagation::TextMapPropagator;
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;

        let context = propagator().extract(&Extracted::from(header));
        let linked = context.span().span_context().clone();
        if linked.is_valid() {
            span.add_link(linked);
        }
    }
    #[cfg(not(feature = "otel"))]
    let _ = (span, header);
}

#[cfg(feature = "otel")]
fn propagator() -> opentelemetry_sdk::propagation::TraceContextPropagator {
    opentelemetry_sdk::propagation::TraceContextPropagator::new()
}

#[cfg(feature = "otel")]
struct Injected<'a>(&'a mut Vec<(String, String)>);

#[cfg(feature = "otel")]
impl opentelemetry::propagation::Injector for Injected<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator writes an empty `tracestate` when the span has none.
        if !value.is_empty() {
            self.0.push((key.to_owned(), value));
        }
    }
}

/// The trace context's headers as found.
#[cfg(feature = "otel")]
struct Extracted<'h>([(&'static str, Option<&'h str>); 2]);

#[cfg(feature = "otel")]
impl<'h> Extracted<'h> {
    fn from(header: impl Fn(&str) -> Option<&'h str>) -> Self {
        Self([TRACEPARENT, TRACESTATE].map(|name| (name, header(name))))
    }
}

#[cfg(feature = "otel")]
impl opentelemetry::propagation::Extractor for Extracted<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let found = self
            .0
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(key));
        found.and_then(|(_, value)| *value)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| *name).collect()
    }
}
