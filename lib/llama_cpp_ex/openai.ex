defmodule LlamaCppEx.OpenAI do
  @moduledoc """
  The OpenAI HTTP API without HTTP: a decoded JSON body in, an OpenAI-shaped map (or a stream
  of server-sent events) out, served by a `LlamaCppEx.Server`. `LlamaCppEx.HTTPServer` puts it
  on a port; a Phoenix app can mount it from a controller:

      defmodule MyAppWeb.OpenAIController do
        use MyAppWeb, :controller

        @api LlamaCppEx.OpenAI.new(server: MyApp.LLM, model_name: "smollm2")

        def handle(conn, _params) do
          case LlamaCppEx.OpenAI.handle(@api, conn.method, conn.request_path, conn.body_params) do
            {:json, status, body} ->
              conn |> put_status(status) |> json(body)

            {:sse, events} ->
              conn =
                conn
                |> put_resp_content_type("text/event-stream")
                |> send_chunked(200)

              Enum.reduce_while(Stream.concat(events, [:done]), conn, fn event, conn ->
                case chunk(conn, LlamaCppEx.OpenAI.sse(event)) do
                  {:ok, conn} -> {:cont, conn}
                  {:error, _closed} -> {:halt, conn}
                end
              end)
          end
        end
      end

  (route `post "/v1/*path"` and `get "/v1/models"` to it; halting the event stream when the
  client has gone cancels the request.)

  ## Routes

    * `POST /v1/chat/completions` — `messages`, `stream`, `stream_options.include_usage`,
      `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k`, `min_p`,
      `seed`, `stop`, `logprobs` / `top_logprobs`, `response_format` (`json_object`,
      `json_schema`, and llama-server's `{"type": "json_object", "schema": …}`),
      `presence_penalty`, `frequency_penalty`, `logit_bias`, `tools`, `tool_choice`,
      `parallel_tool_calls`, `n` (several choices from one prompt, generated side by side and
      sharing its KV prefix through the server's cache; streamed, their chunks interleave,
      each with its choice's `index`).
    * `POST /v1/completions` — `prompt` (a string, token ids, or a list of either: one choice
      each; a stream takes one), `echo`, `logprobs` (a count), `stream`, and the sampling
      fields above.
    * `POST /v1/embeddings` — `input` (a string, a list, token ids), `encoding_format`
      (`float` or `base64`); L2-normalised; `dimensions` is refused.
    * `POST /v1/rerank` (also `/rerank`, `/v1/reranking`) — `query`, `documents` (strings
      or `{"text": …}`), `top_n`, `return_documents`: `results` of `{index,
      relevance_score}`, best first (llama-server's, Jina's and Cohere's shape), on a
      reranking model (a classification head, or a Qwen3-Reranker-style decoder).
    * `GET /v1/models`, `GET /health` (503 while the model loads or the server does not
      answer within a second), `POST /tokenize`,
      `POST /detokenize`.

  Fields this API does not know are ignored, as llama-server and OpenAI do; so is `model`
  (one API serves one model, as llama-server does). Errors are
  OpenAI's `{"error": {"message", "type", "param", "code"}}`: 400 for bad input, 404 for an
  unknown route or model, 503 when the server's queue is full or the model is loading, 500
  (with no internal detail) otherwise.
  """

  alias LlamaCppEx.{Completion, Generation, JSON, Model, Server, Source, Tokenizer}

  defstruct [:server, :cluster, :model_name, :embeddings, created: 0]

  @type t :: %__MODULE__{
          server: GenServer.server() | nil,
          cluster: term(),
          model_name: String.t(),
          embeddings: GenServer.server() | nil,
          created: integer()
        }

  @type result :: {:json, pos_integer(), map()} | {:sse, Enumerable.t()}

  @doc """
  The API over `:server`, or over `:cluster` (a `LlamaCppEx.Cluster` group: each request
  runs on the replica the group's routing picks for its messages or prompt). Options:
  `:server` or `:cluster` (one is required), `:model_name` (what `/v1/models` lists and
  responses name; default `"local"`), `:embeddings` (another server for `/v1/embeddings`;
  default the main one).
  """
  @spec new(keyword()) :: t()
  def new(opts) do
    unless Keyword.has_key?(opts, :server) != Keyword.has_key?(opts, :cluster),
      do: raise(ArgumentError, "LlamaCppEx.OpenAI.new/1 needs one of :server and :cluster")

    %__MODULE__{
      server: opts[:server],
      cluster: opts[:cluster],
      model_name: Keyword.get(opts, :model_name, "local"),
      embeddings: Keyword.get(opts, :embeddings),
      created: System.os_time(:second)
    }
  end

  @doc "Handles one request: `method` (\"GET\", \"POST\"), `path`, the decoded JSON body."
  @spec handle(t(), String.t(), String.t(), map() | nil) :: result()
  def handle(%__MODULE__{cluster: group} = api, method, path, body) when group != nil,
    do: LlamaCppEx.Cluster.handle_openai(api, method, path, body || %{})

  def handle(api, method, path, body) do
    route(api, method, path, body || %{})
  rescue
    e in ArgumentError -> error(400, Exception.message(e))
  catch
    :exit, {:noproc, _} -> error(503, "the model server is not running", "unavailable")
    :exit, {:timeout, _} -> error(504, "the request timed out", "timeout")
  end

  defp route(api, "POST", "/v1/chat/completions", body), do: chat(api, body)
  defp route(api, "POST", "/chat/completions", body), do: chat(api, body)
  defp route(api, "POST", "/v1/completions", body), do: completions(api, body)
  defp route(api, "POST", "/completions", body), do: completions(api, body)
  defp route(api, "POST", "/v1/embeddings", body), do: embeddings(api, body)
  defp route(api, "POST", "/embeddings", body), do: embeddings(api, body)

  defp route(api, "POST", p, body) when p in ["/v1/rerank", "/rerank", "/v1/reranking"],
    do: rerank(api, body)

  defp route(api, "GET", "/v1/models", _), do: models(api)
  defp route(api, "GET", "/models", _), do: models(api)
  defp route(api, "GET", "/health", _), do: health(api)
  defp route(api, "POST", "/tokenize", body), do: tokenize(api, body)
  defp route(api, "POST", "/detokenize", body), do: detokenize(api, body)

  defp route(_api, method, path, _),
    do: error(404, "no route #{method} #{path}", "not_found_error")

  ## Chat

  defp chat(api, body) do
    with {:ok, messages} <- field(body, "messages", &is_list/1, "a list of messages"),
         {:ok, opts} <- sampling(body),
         {:ok, opts} <- chat_options(body, opts),
         {:ok, n} <- n_choices(body) do
      if body["stream"] == true do
        chat_stream(api, messages, body, opts, n)
      else
        chat_blocking(api, messages, opts, n)
      end
    end
  end

  defp chat_blocking(api, messages, opts, 1) do
    case LlamaCppEx.chat_completion(api.server, messages, opts) do
      {:ok, c} -> {:json, 200, completion_json(api, c)}
      {:error, reason} -> engine_error(reason)
    end
  end

  defp chat_blocking(api, messages, opts, n) do
    results =
      1..n
      |> Task.async_stream(fn _ -> LlamaCppEx.chat_completion(api.server, messages, opts) end,
        timeout: :infinity,
        ordered: true
      )
      |> Enum.map(fn {:ok, r} -> r end)

    case Enum.find(results, &match?({:error, _}, &1)) do
      {:error, reason} ->
        engine_error(reason)

      nil ->
        completions = for {:ok, c} <- results, do: c
        first = hd(completions)

        choices =
          completions
          |> Enum.with_index()
          |> Enum.map(fn {c, i} -> %{hd(c.choices) | index: i} end)

        n_prompt = first.usage.prompt_tokens
        n_out = Enum.sum(for c <- completions, do: c.usage.completion_tokens)

        usage = %{
          prompt_tokens: n_prompt,
          completion_tokens: n_out,
          total_tokens: n_prompt + n_out
        }

        {:json, 200, completion_json(api, %{first | choices: choices, usage: usage})}
    end
  end

  defp chat_stream(api, messages, body, opts, n) do
    include_usage = get_in(body, ["stream_options", "include_usage"]) == true
    opts = [include_usage: include_usage] ++ opts
    open = fn -> LlamaCppEx.stream_chat_completion(api.server, messages, opts) end
    chunks = if n == 1, do: open.(), else: interleave(for(_ <- 1..n, do: open), include_usage)

    {:sse,
     Stream.map(chunks, fn
       {:error, reason} -> {:error, error_body(engine_error(reason))}
       chunk -> {:data, completion_json(api, chunk)}
     end)}
  end

  # `n` streamed choices: each runs in a process of its own (the server generates them
  # side by side) and its chunks arrive here as they come, their choice renumbered; usage
  # chunks are summed into one at the end. Halting the result kills the producers, which
  # cancels their requests.
  defp interleave(opens, include_usage) do
    Stream.resource(
      fn ->
        parent = self()
        ref = make_ref()

        pids =
          for {open, i} <- Enum.with_index(opens) do
            spawn_link(fn ->
              Enum.each(open.(), &send(parent, {ref, i, &1}))
              send(parent, {ref, i, :end})
            end)
          end

        %{ref: ref, pids: pids, open: length(pids), usage: nil, base: nil}
      end,
      fn
        %{open: 0} = st ->
          {:halt, st}

        st ->
          receive do
            {ref, _i, :end} when ref == st.ref ->
              st = %{st | open: st.open - 1}

              if st.open == 0 and include_usage and st.usage,
                do: {[%{st.base | choices: [], usage: st.usage}], st},
                else: {[], st}

            {ref, _i, {:error, _} = e} when ref == st.ref ->
              {[e], %{st | open: 0}}

            {ref, _i, %{choices: [], usage: u} = c} when ref == st.ref ->
              {[], %{st | usage: add_usage(st.usage, u), base: st.base || c}}

            {ref, i, %{choices: [choice]} = c} when ref == st.ref ->
              base = st.base || c
              {[%{c | id: base.id, choices: [%{choice | index: i}]}], %{st | base: base}}
          end
      end,
      fn st -> Enum.each(st.pids, &(Process.unlink(&1) && Process.exit(&1, :kill))) end
    )
  end

  # the prompt is shared: counted once
  defp add_usage(nil, u), do: u

  defp add_usage(acc, u) do
    n = acc.completion_tokens + u.completion_tokens
    %{acc | completion_tokens: n, total_tokens: acc.prompt_tokens + n}
  end

  defp completion_json(api, c) do
    c
    |> Map.from_struct()
    |> Map.put(:model, api.model_name)
    |> Map.reject(fn {k, v} -> k == :usage and v == nil end)
  end

  defp chat_options(body, opts) do
    with {:ok, opts} <- response_format(body["response_format"], opts) do
      tools = if is_list(body["tools"]), do: [tools: body["tools"]], else: []
      choice = if body["tool_choice"] != nil, do: [tool_choice: body["tool_choice"]], else: []

      parallel =
        if is_boolean(body["parallel_tool_calls"]),
          do: [parallel_tool_calls: body["parallel_tool_calls"]],
          else: []

      logprobs =
        case body do
          %{"logprobs" => true} -> [logprobs: true, top_logprobs: body["top_logprobs"] || 0]
          _ -> []
        end

      {:ok, opts ++ tools ++ choice ++ parallel ++ logprobs}
    end
  end

  defp response_format(nil, opts), do: {:ok, opts}
  defp response_format(%{"type" => "text"}, opts), do: {:ok, opts}

  defp response_format(%{"type" => "json_object"} = f, opts),
    do: {:ok, [json_schema: f["schema"] || %{"type" => "object"}] ++ opts}

  defp response_format(%{"type" => "json_schema", "json_schema" => %{"schema" => s}}, opts)
       when is_map(s),
       do: {:ok, [json_schema: s] ++ opts}

  defp response_format(other, _opts),
    do: bad("unsupported response_format: #{JSON.encode!(other)}", "response_format")

  defp n_choices(body) do
    case Map.get(body, "n", 1) do
      n when is_integer(n) and n in 1..16 -> {:ok, n}
      other -> bad("n must be an integer from 1 to 16, got #{inspect(other)}", "n")
    end
  end

  ## Completions

  defp completions(api, body) do
    with {:ok, prompts} <- prompts(body["prompt"]),
         {:ok, opts} <- sampling(body) do
      opts =
        case body["logprobs"] do
          n when is_integer(n) and n > 0 -> [logprobs: true, top_logprobs: n] ++ opts
          _ -> opts
        end

      echo? = body["echo"] == true

      case {body["stream"] == true, prompts} do
        {true, [prompt]} -> completion_stream(api, prompt, opts, echo?)
        {true, _} -> bad("a streamed completion takes one prompt", "prompt")
        {false, _} -> completion_blocking(api, prompts, opts, echo?)
      end
    end
  end

  # a string, token ids, or a list of either (one choice each)
  defp prompts(p) when is_binary(p), do: {:ok, [p]}

  defp prompts([i | _] = ids) when is_integer(i) do
    if Enum.all?(ids, &is_integer/1),
      do: {:ok, [ids]},
      else: bad("prompt: mixed token ids", "prompt")
  end

  defp prompts([_ | _] = list) do
    if Enum.all?(
         list,
         &(is_binary(&1) or
             (is_list(&1) and &1 != [] and Enum.all?(&1, fn i -> is_integer(i) end)))
       ),
       do: {:ok, list},
       else: bad("prompt must be strings or lists of token ids", "prompt")
  end

  defp prompts(other),
    do:
      bad(
        "prompt must be a string, token ids, or a list of either, got #{short(other)}",
        "prompt"
      )

  defp open_completion(api, prompt, opts, mode) do
    opts = Generation.options!(opts, :server)
    Server.open(api.server, fn _ -> {:ok, prompt} end, opts, mode, 60_000)
  end

  defp completion_blocking(api, prompts, opts, echo?) do
    results =
      prompts
      |> Task.async_stream(&completion_one(api, &1, opts, echo?), timeout: :infinity)
      |> Enum.map(fn {:ok, r} -> r end)

    case Enum.find(results, &match?({:error, _}, &1)) do
      {:error, reason} ->
        engine_error(reason)

      nil ->
        choices =
          for {{:ok, choice, _, _}, i} <- Enum.with_index(results), do: %{choice | index: i}

        n_prompt = Enum.sum(for {:ok, _, p, _} <- results, do: p)
        n_out = Enum.sum(for {:ok, _, _, n} <- results, do: n)

        {:json, 200,
         %{
           id: "cmpl-" <> rand_id(),
           object: "text_completion",
           created: System.os_time(:second),
           model: api.model_name,
           choices: choices,
           usage: %{
             prompt_tokens: n_prompt,
             completion_tokens: n_out,
             total_tokens: n_prompt + n_out
           }
         }}
    end
  end

  defp completion_one(api, prompt, opts, echo?) do
    with {:ok, src, gen} <- open_completion(api, prompt, opts, :generate),
         {:ok, r} <- Source.collect(src) do
      choice = %{
        index: 0,
        text: if(echo?, do: prompt_text(gen) <> r.text, else: r.text),
        finish_reason: Completion.finish_reason(r.reason),
        logprobs: if(gen.logprobs, do: legacy_logprobs(r.logprobs))
      }

      {:ok, choice, length(gen.tokens), r.completion_tokens}
    end
  end

  defp completion_stream(api, prompt, opts, echo?) do
    case open_completion(api, prompt, opts, :stream) do
      {:ok, src, gen} ->
        id = "cmpl-" <> rand_id()

        base = %{
          id: id,
          object: "text_completion",
          created: System.os_time(:second),
          model: api.model_name
        }

        chunk = fn text, finish ->
          {:data, Map.put(base, :choices, [%{index: 0, text: text, finish_reason: finish}])}
        end

        first = if echo?, do: [chunk.(prompt_text(gen), nil)], else: []

        rest =
          Stream.resource(
            fn -> src end,
            fn
              :done ->
                {:halt, :done}

              src ->
                {status, events, src} = Source.next(src)

                out =
                  Enum.flat_map(events, fn
                    {:token, t} -> [chunk.(t, nil)]
                    {:done, reason} -> [chunk.("", Completion.finish_reason(reason))]
                    {:error, reason} -> [{:error, error_body(engine_error(reason))}]
                    _ -> []
                  end)

                {out, if(status == :done, do: Source.close(src) && :done, else: src)}
            end,
            fn
              :done -> :ok
              src -> Source.close(src)
            end
          )

        {:sse, Stream.concat(first, rest)}

      {:error, reason} ->
        engine_error(reason)
    end
  end

  defp prompt_text(%{tokens: ids, model: model}) do
    case Tokenizer.decode(model, ids) do
      {:ok, text} -> text
      _ -> ""
    end
  end

  defp legacy_logprobs(lps) do
    %{
      tokens: for({piece, _} <- lps, do: piece),
      token_logprobs: for({_, {lp, _}} <- lps, do: lp),
      top_logprobs: for({_, {_, top}} <- lps, do: Map.new(top, fn {_id, p, l} -> {p, l} end))
    }
  end

  ## Embeddings

  defp embeddings(api, body) do
    server = api.embeddings || api.server

    with :ok <- no_dimensions(body),
         {:ok, inputs} <- inputs(body["input"]),
         {:ok, format} <- encoding_format(body["encoding_format"]) do
      case Server.embed(server, inputs, normalize: 2) do
        {:ok, vectors} ->
          data =
            vectors
            |> Enum.with_index()
            |> Enum.map(fn {v, i} ->
              %{object: "embedding", index: i, embedding: encode_vector(v, format)}
            end)

          tokens = count_tokens(server, inputs)

          {:json, 200,
           %{
             object: "list",
             data: data,
             model: api.model_name,
             usage: %{prompt_tokens: tokens, total_tokens: tokens}
           }}

        {:error, reason} ->
          engine_error(reason)
      end
    end
  end

  defp no_dimensions(%{"dimensions" => d}) when d != nil,
    do:
      bad("dimensions is not supported: this model's embeddings have a fixed size", "dimensions")

  defp no_dimensions(_), do: :ok

  defp inputs(s) when is_binary(s), do: {:ok, [s]}

  defp inputs([_ | _] = list) do
    cond do
      Enum.all?(list, &is_binary/1) ->
        {:ok, list}

      Enum.all?(list, &is_integer/1) ->
        {:ok, [list]}

      Enum.all?(list, fn x -> is_list(x) and x != [] and Enum.all?(x, &is_integer/1) end) ->
        {:ok, list}

      true ->
        bad("input must be a string, a list of strings or token ids", "input")
    end
  end

  defp inputs(other),
    do:
      bad("input must be a string, a list of strings or token ids, got #{short(other)}", "input")

  defp encoding_format(f) when f in [nil, "float"], do: {:ok, :float}
  defp encoding_format("base64"), do: {:ok, :base64}

  defp encoding_format(other),
    do: bad("encoding_format must be float or base64, got #{short(other)}", "encoding_format")

  defp encode_vector(v, :float), do: v

  defp encode_vector(v, :base64),
    do: Base.encode64(for x <- v, into: <<>>, do: <<x::float-32-little>>)

  defp count_tokens(server, inputs) do
    case Server.fetch_model(server) do
      {:ok, model} ->
        Enum.sum(
          for i <- inputs do
            if is_list(i), do: length(i), else: length(elem(Tokenizer.encode(model, i), 1))
          end
        )

      _ ->
        0
    end
  end

  ## Rerank

  # llama-server's, Jina's and Cohere's shape: results by relevance, best first
  defp rerank(api, body) do
    with {:ok, query} <- field(body, "query", &is_binary/1, "a string"),
         {:ok, docs} <- field(body, "documents", &(is_list(&1) and &1 != []), "a non-empty list"),
         {:ok, texts} <- document_texts(docs),
         {:ok, top_n} <- top_n(body["top_n"], length(texts)),
         {:ok, model} <- loaded(api) do
      case LlamaCppEx.rerank(model, query, texts) do
        {:ok, scores} ->
          results =
            scores
            |> Enum.with_index()
            |> Enum.sort_by(fn {score, _} -> -score end)
            |> Enum.take(top_n)
            |> Enum.map(fn {score, i} ->
              r = %{index: i, relevance_score: score}

              if body["return_documents"] == true,
                do: Map.put(r, :document, %{text: Enum.at(texts, i)}),
                else: r
            end)

          tokens = count_tokens(api.server, [query | texts])

          {:json, 200,
           %{
             object: "list",
             model: api.model_name,
             results: results,
             usage: %{prompt_tokens: tokens, total_tokens: tokens}
           }}

        {:error, reason} ->
          engine_error(reason)
      end
    end
  end

  defp document_texts(docs) do
    texts = Enum.map(docs, fn d -> if is_map(d), do: d["text"], else: d end)

    if Enum.all?(texts, &is_binary/1),
      do: {:ok, texts},
      else: bad("documents must be strings or objects with a text", "documents")
  end

  defp top_n(nil, n), do: {:ok, n}
  defp top_n(k, _n) when is_integer(k) and k > 0, do: {:ok, k}
  defp top_n(k, _n), do: bad("top_n must be a positive integer, got #{short(k)}", "top_n")

  ## Models, health, tokens

  defp models(api) do
    {:json, 200,
     %{
       object: "list",
       data: [
         %{id: api.model_name, object: "model", created: api.created, owned_by: "llama_cpp_ex"}
       ]
     }}
  end

  # a server still loading its model answers no call until it is done: wait a second at most
  defp health(api) do
    caller = self()

    {pid, ref} =
      spawn_monitor(fn -> send(caller, {:health, self(), Server.fetch_model(api.server)}) end)

    answer =
      receive do
        {:health, ^pid, {:ok, _}} -> {:json, 200, %{status: "ok"}}
        {:health, ^pid, _} -> error(503, "Loading model", "unavailable_error")
      after
        1_000 -> error(503, "Loading model", "unavailable_error")
      end

    Process.exit(pid, :kill)

    receive do
      {:DOWN, ^ref, _, _, _} -> :ok
    end

    receive do
      {:health, ^pid, _} -> :ok
    after
      0 -> :ok
    end

    answer
  end

  defp tokenize(api, body) do
    with {:ok, content} <- field(body, "content", &is_binary/1, "a string"),
         {:ok, model} <- loaded(api) do
      add_special = body["add_special"] == true

      case Tokenizer.encode(model, content, add_special: add_special) do
        {:ok, ids} -> {:json, 200, %{tokens: ids}}
        {:error, reason} -> engine_error(reason)
      end
    end
  end

  defp detokenize(api, body) do
    with {:ok, ids} <-
           field(
             body,
             "tokens",
             &(is_list(&1) and Enum.all?(&1, fn i -> is_integer(i) end)),
             "a list of token ids"
           ),
         {:ok, model} <- loaded(api) do
      case Tokenizer.decode(model, ids) do
        {:ok, text} -> {:json, 200, %{content: text}}
        {:error, reason} -> engine_error(reason)
      end
    end
  end

  defp loaded(api) do
    case Server.fetch_model(api.server) do
      {:ok, %Model{} = m} -> {:ok, m}
      _ -> error(503, "Loading model", "unavailable_error")
    end
  end

  ## Fields

  # the request's sampling fields as LlamaCppEx options
  defp sampling(body) do
    pairs = [
      {"max_tokens", :max_tokens},
      {"max_completion_tokens", :max_tokens},
      {"temperature", :temp},
      {"top_p", :top_p},
      {"top_k", :top_k},
      {"min_p", :min_p},
      {"seed", :seed},
      {"presence_penalty", :penalty_present},
      {"frequency_penalty", :penalty_freq},
      {"repeat_penalty", :penalty_repeat}
    ]

    opts = for {k, key} <- pairs, v = body[k], v != nil, do: {key, v}

    with {:ok, stop} <- stop(body["stop"]),
         {:ok, bias} <- logit_bias(body["logit_bias"]) do
      {:ok, opts ++ stop ++ bias}
    end
  end

  defp stop(nil), do: {:ok, []}
  defp stop(s) when is_binary(s), do: {:ok, [stop: [s]]}
  defp stop([]), do: {:ok, []}

  defp stop(l) when is_list(l) do
    if Enum.all?(l, &is_binary/1), do: {:ok, [stop: l]}, else: bad("stop must be strings", "stop")
  end

  defp stop(other),
    do: bad("stop must be a string or a list of strings, got #{short(other)}", "stop")

  defp logit_bias(nil), do: {:ok, []}

  defp logit_bias(%{} = m) do
    Enum.reduce_while(m, {:ok, %{}}, fn {k, v}, {:ok, acc} ->
      case Integer.parse(to_string(k)) do
        {id, ""} when is_number(v) -> {:cont, {:ok, Map.put(acc, id, v * 1.0)}}
        _ -> {:halt, bad("logit_bias maps token ids to numbers", "logit_bias")}
      end
    end)
    |> case do
      {:ok, bias} -> {:ok, [logit_bias: bias]}
      error -> error
    end
  end

  defp logit_bias(_), do: bad("logit_bias must be an object", "logit_bias")

  defp field(body, key, ok?, what) do
    v = body[key]
    if v != nil and ok?.(v), do: {:ok, v}, else: bad("#{key} must be #{what}", key)
  end

  ## Errors and events

  @doc "An error result in OpenAI's shape."
  @spec error(pos_integer(), String.t(), String.t(), String.t() | nil) ::
          {:json, pos_integer(), map()}
  def error(status, message, type \\ "invalid_request_error", param \\ nil) do
    {:json, status, %{error: %{message: message, type: type, param: param, code: code(status)}}}
  end

  defp code(400), do: "invalid_request_error"
  defp code(401), do: "invalid_api_key"
  defp code(404), do: "not_found"
  defp code(413), do: "request_too_large"
  defp code(503), do: "unavailable"
  defp code(_), do: nil

  defp bad(message, param), do: error(400, message, "invalid_request_error", param)

  defp error_body({:json, _status, body}), do: body

  # engine answers: the caller's mistakes are 400, a full queue 503, anything else 500
  defp engine_error(:queue_full),
    do: error(503, "the server's queue is full; retry later", "unavailable_error")

  defp engine_error(:not_ready), do: error(503, "Loading model", "unavailable_error")

  defp engine_error(:server_down),
    do: error(503, "the model server went down", "unavailable_error")

  defp engine_error(:timeout), do: error(504, "the request timed out", "timeout")

  defp engine_error(:context_full),
    do: error(400, "the prompt does not fit the context", "invalid_request_error")

  defp engine_error(:empty_prompt), do: error(400, "the prompt is empty")
  defp engine_error(:invalid_token), do: error(400, "a token id is outside the vocabulary")
  defp engine_error(:invalid_grammar), do: error(400, "the grammar does not compile")
  defp engine_error(:not_generative_model), do: error(400, "this model only embeds")
  defp engine_error(reason) when is_binary(reason), do: error(400, reason)
  defp engine_error(_reason), do: error(500, "internal error", "server_error")

  @doc false
  # the servers behind the API, for metrics
  @spec servers(t()) :: [GenServer.server()]
  def servers(%__MODULE__{cluster: nil, server: server}), do: [server]

  def servers(%__MODULE__{cluster: group}),
    do: Enum.map(LlamaCppEx.Cluster.replicas(group), & &1.pid)

  @doc "One SSE event's bytes: `{:data, map}`, `{:error, body}` or `:done`."
  @spec sse({:data, map()} | {:error, map()} | :done) :: iodata()
  def sse({:data, map}), do: ["data: ", JSON.encode!(map), "\n\n"]
  def sse({:error, body}), do: ["event: error\ndata: ", JSON.encode!(body), "\n\n"]
  def sse(:done), do: "data: [DONE]\n\n"

  defp rand_id, do: Base.encode16(:crypto.strong_rand_bytes(12), case: :lower)

  defp short(v), do: v |> inspect() |> String.slice(0, 60)
end
