defmodule LlamaCppEx.HTTPServer.Metrics do
  @moduledoc """
  `GET /metrics` of `LlamaCppEx.HTTPServer`, in Prometheus' text format. Names follow
  llama.cpp's server (`llamacpp:`-style counters) and vLLM's where they overlap, under the
  `llamacppex_` prefix:

    * `llamacppex_requests_total{route, status}` - HTTP requests answered;
    * `llamacppex_prompt_tokens_total`, `llamacppex_generation_tokens_total`,
      `llamacppex_prefix_cache_hit_tokens_total`, `llamacppex_requests_completed_total` -
      from the Server's counters;
    * `llamacppex_time_to_first_token_seconds`, `llamacppex_inter_token_latency_seconds` -
      histograms over streamed responses (first content event, then the gaps between them);
    * `llamacppex_queue_depth`, `llamacppex_busy_slots`, `llamacppex_slots`,
      `llamacppex_kv_capacity_tokens`, `llamacppex_kv_free_tokens` - gauges read at scrape
      time (KV in use is capacity minus free);
    * `llamacppex_speculative_drafted_tokens_total`,
      `llamacppex_speculative_accepted_tokens_total`.
  """

  @buckets [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]

  @doc false
  def new do
    :ets.new(__MODULE__, [:public, :set, write_concurrency: true])
  end

  @doc false
  def request(table, path, status) do
    :ets.update_counter(table, {:requests, path_label(path), status}, 1, {nil, 0})
  end

  @doc false
  # one streamed event: `first?` the time to the first token, else an inter-token gap
  def token_gap(table, native, first?) do
    seconds = System.convert_time_unit(native, :native, :microsecond) / 1.0e6
    name = if first?, do: :ttft, else: :itl
    bucket = Enum.find(@buckets, :inf, &(seconds <= &1))
    :ets.update_counter(table, {:hist, name, bucket}, 1, {nil, 0})
    :ets.update_counter(table, {:hist_count, name}, 1, {nil, 0})
    :ets.update_counter(table, {:hist_sum_us, name}, round(seconds * 1.0e6), {nil, 0})
  end

  defp path_label(path) when path in ~w(/v1/chat/completions /v1/completions /v1/embeddings
                                         /v1/models /health /tokenize /detokenize /metrics),
    do: path

  defp path_label(_), do: "other"

  @doc false
  def render(table, servers) do
    # summed over the servers (one, or a cluster group's replicas)
    stats =
      servers
      |> Enum.map(fn server ->
        try do
          LlamaCppEx.Server.get_stats(server)
        catch
          :exit, _ -> %{}
        end
      end)
      |> Enum.reduce(%{}, fn s, acc ->
        Map.merge(acc, s, fn _, a, b -> if is_number(a) and is_number(b), do: a + b, else: a end)
      end)

    rows = :ets.tab2list(table)

    [
      counter(
        "llamacppex_requests_total",
        "HTTP requests answered",
        for(
          {{:requests, route, status}, n} <- rows,
          do: {~s(route="#{route}",status="#{status}"), n}
        )
      ),
      counter("llamacppex_prompt_tokens_total", "Prompt tokens of finished requests", [
        {"", stats[:prompt_tokens] || 0}
      ]),
      counter("llamacppex_generation_tokens_total", "Generated tokens", [
        {"", stats[:tokens_generated] || 0}
      ]),
      counter("llamacppex_prefix_cache_hit_tokens_total", "Prompt tokens served from cached KV", [
        {"", stats[:prefix_cache_tokens] || 0}
      ]),
      counter("llamacppex_requests_completed_total", "Finished generation requests", [
        {"", stats[:requests_completed] || 0}
      ]),
      counter("llamacppex_speculative_drafted_tokens_total", "Drafted tokens", [
        {"", stats[:speculative_drafted] || 0}
      ]),
      counter("llamacppex_speculative_accepted_tokens_total", "Accepted drafted tokens", [
        {"", stats[:speculative_accepted] || 0}
      ]),
      gauge("llamacppex_queue_depth", "Requests waiting for a slot", stats[:queue_depth] || 0),
      gauge("llamacppex_busy_slots", "Slots prefilling or generating", stats[:active_slots] || 0),
      gauge("llamacppex_slots", "Slots", stats[:n_parallel] || 0),
      gauge(
        "llamacppex_kv_capacity_tokens",
        "KV cache tokens the server's context holds",
        stats[:n_ctx] || 0
      ),
      gauge(
        "llamacppex_kv_free_tokens",
        "KV cache tokens free after the last pass",
        stats[:kv_free_tokens] || 0
      ),
      histogram(
        rows,
        :ttft,
        "llamacppex_time_to_first_token_seconds",
        "Time to the first streamed token"
      ),
      histogram(
        rows,
        :itl,
        "llamacppex_inter_token_latency_seconds",
        "Time between streamed tokens"
      )
    ]
  end

  defp counter(name, help, samples) do
    [
      "# HELP #{name} #{help}\n# TYPE #{name} counter\n"
      | for({labels, v} <- samples, do: sample(name, labels, v))
    ]
  end

  defp gauge(name, help, v),
    do: ["# HELP #{name} #{help}\n# TYPE #{name} gauge\n", sample(name, "", v)]

  defp histogram(rows, key, name, help) do
    counts = Map.new(for {{:hist, ^key, b}, n} <- rows, do: {b, n})

    {lines, _} =
      Enum.map_reduce(@buckets ++ [:inf], 0, fn b, acc ->
        acc = acc + Map.get(counts, b, 0)
        le = if b == :inf, do: "+Inf", else: to_string(b)
        {sample(name <> "_bucket", ~s(le="#{le}"), acc), acc}
      end)

    count =
      Enum.find_value(rows, 0, fn
        {{:hist_count, ^key}, n} -> n
        _ -> nil
      end)

    sum_us =
      Enum.find_value(rows, 0, fn
        {{:hist_sum_us, ^key}, n} -> n
        _ -> nil
      end)

    [
      "# HELP #{name} #{help}\n# TYPE #{name} histogram\n",
      lines,
      sample(name <> "_sum", "", sum_us / 1.0e6),
      sample(name <> "_count", "", count)
    ]
  end

  defp sample(name, "", v), do: "#{name} #{v}\n"
  defp sample(name, labels, v), do: "#{name}{#{labels}} #{v}\n"
end
