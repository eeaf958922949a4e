defmodule LlamaCppEx.HTTPServerTest do
  # The OpenAI API: its core without HTTP, the HTTP layer on raw sockets, and the official
  # `openai` Python client (installed by scripts/setup.sh) against a live server.
  use ExUnit.Case, async: false
  import LlamaCppEx.Eventually, only: [wait_until: 1, wait_until: 2]

  alias LlamaCppEx.{CLI, HTTPServer, JSON, OpenAI, Server, TestModels}

  @moduletag timeout: 600_000

  setup_all do
    {:ok, server} =
      Server.start_link(model_path: TestModels.smollm2_path(), n_parallel: 8, n_ctx: 8192)

    {:ok, _} = TestModels.wait_model(server)

    {:ok, http} =
      HTTPServer.start_link(server: server, port: 0, api_key: "sekret", max_body: 4096)

    on_exit(fn -> Process.exit(server, :normal) end)
    %{server: server, http: http, port: HTTPServer.port(http), api: OpenAI.new(server: server)}
  end

  describe "the core, without HTTP" do
    test "chat completions as OpenAI maps", %{api: api} do
      body = %{
        "messages" => [%{"role" => "user", "content" => "Hi"}],
        "max_tokens" => 4,
        "temperature" => 0
      }

      assert {:json, 200, r} = OpenAI.handle(api, "POST", "/v1/chat/completions", body)
      assert r.object == "chat.completion" and r.model == "local"
      assert [%{message: %{role: "assistant", content: text}}] = r.choices
      assert is_binary(text)

      assert {:sse, events} =
               OpenAI.handle(api, "POST", "/v1/chat/completions", Map.put(body, "stream", true))

      deltas = for {:data, %{choices: [c]}} <- Enum.to_list(events), do: c.delta
      assert Enum.map_join(deltas, &Map.get(&1, :content, "")) == text
    end

    test "completions: one choice per prompt, strings or token ids", %{api: api, server: server} do
      {:ok, model} = Server.fetch_model(server)
      {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, "The sky is", add_special: false)
      body = %{"prompt" => ["The sky is", ids], "max_tokens" => 6, "temperature" => 0}
      assert {:json, 200, r} = OpenAI.handle(api, "POST", "/v1/completions", body)
      assert [%{index: 0, text: a}, %{index: 1, text: b}] = r.choices
      # the same prompt as text and as ids: the same greedy text
      assert a == b and a != ""
      assert r.usage.completion_tokens in 2..12
    end

    test "bad input: one OpenAI-shaped 400 per condition", %{api: api} do
      cases = [
        {"/v1/chat/completions", %{"messages" => "x"}, "messages must be a list of messages"},
        {"/v1/chat/completions", %{"messages" => [], "n" => 0}, "n must be an integer"},
        {"/v1/chat/completions",
         %{"messages" => [%{"role" => "user", "content" => "x"}], "stop" => 5}, "stop must be"},
        {"/v1/chat/completions",
         %{
           "messages" => [%{"role" => "user", "content" => "x"}],
           "response_format" => %{"type" => "yaml"}
         }, "unsupported response_format"},
        {"/v1/completions", %{"prompt" => %{}}, "prompt must be"},
        {"/v1/completions", %{"prompt" => ["a", 1]}, "prompt must be strings or lists"},
        {"/v1/completions", %{"prompt" => ["a", "b"], "stream" => true},
         "a streamed completion takes one prompt"},
        {"/v1/completions", %{"prompt" => ""}, "the prompt is empty"},
        {"/v1/embeddings", %{"input" => 3}, "input must be"},
        {"/v1/embeddings", %{"input" => "x", "dimensions" => 4}, "dimensions is not supported"},
        {"/v1/embeddings", %{"input" => "x", "encoding_format" => "hex"},
         "encoding_format must be"},
        {"/tokenize", %{"content" => 1}, "content must be a string"},
        {"/detokenize", %{"tokens" => ["a"]}, "tokens must be a list of token ids"}
      ]

      for {path, body, msg} <- cases do
        assert {:json, 400, %{error: e}} = OpenAI.handle(api, "POST", path, body)
        assert String.starts_with?(e.message, msg), "#{path}: #{e.message}"
        assert e.type == "invalid_request_error"
      end

      assert {:json, 404, %{error: %{type: "not_found_error"}}} =
               OpenAI.handle(api, "GET", "/v1/nothing", nil)
    end

    test "tokenize, detokenize, models, health", %{api: api, server: server} do
      assert {:json, 200, %{tokens: ids}} =
               OpenAI.handle(api, "POST", "/tokenize", %{"content" => "Hello world"})

      {:ok, model} = Server.fetch_model(server)
      assert {:ok, ^ids} = LlamaCppEx.Tokenizer.encode(model, "Hello world", add_special: false)

      assert {:json, 200, %{content: "Hello world"}} =
               OpenAI.handle(api, "POST", "/detokenize", %{"tokens" => ids})

      assert {:json, 200, %{data: [%{id: "local"}]}} =
               OpenAI.handle(api, "GET", "/v1/models", nil)

      assert {:json, 200, %{status: "ok"}} = OpenAI.handle(api, "GET", "/health", nil)
    end

    test "rerank: llama-server's scores, best first, on a reranking model" do
      dir = Path.expand("fixtures/tiny", __DIR__)
      {:ok, fx} = LlamaCppEx.JSON.decode(File.read!(Path.join(dir, "bert.json")))
      %{"query" => q, "documents" => docs, "scores" => want} = fx["rerank"]

      {:ok, rs} =
        Server.start_link(model_path: Path.join(dir, "tiny-bert-rerank-f32.gguf"), n_parallel: 1)

      {:ok, _} = TestModels.wait_model(rs)
      api = OpenAI.new(server: rs, model_name: "rr")

      body = %{"query" => q, "documents" => docs, "return_documents" => true}
      assert {:json, 200, r} = OpenAI.handle(api, "POST", "/v1/rerank", body)
      assert r.model == "rr" and length(r.results) == length(docs)
      scores = Enum.map(r.results, & &1.relevance_score)
      assert scores == Enum.sort(scores, :desc)

      for %{index: i, relevance_score: s, document: %{text: t}} <- r.results do
        assert_in_delta s, Enum.at(want, i), 5.0e-3
        assert t == Enum.at(docs, i)
      end

      objects = Enum.map(docs, &%{"text" => &1})

      assert {:json, 200, %{results: [top]}} =
               OpenAI.handle(api, "POST", "/rerank", %{
                 "query" => q,
                 "documents" => objects,
                 "top_n" => 1
               })

      assert top == Map.delete(hd(r.results), :document)

      assert {:json, 400, %{error: %{param: "top_n"}}} =
               OpenAI.handle(api, "POST", "/v1/rerank", %{
                 "query" => q,
                 "documents" => docs,
                 "top_n" => 0
               })

      GenServer.stop(rs)
    end

    test "health is 503 while the server cannot answer, and without a server" do
      # a Server loading its model answers no call until it is done; so does this stand-in
      silent = spawn(fn -> Process.sleep(:infinity) end)
      api = OpenAI.new(server: silent)

      assert {:json, 503, %{error: %{message: "Loading model"}}} =
               OpenAI.handle(api, "GET", "/health", nil)

      Process.exit(silent, :kill)

      gone = OpenAI.new(server: :no_such_llama_server)
      assert {:json, 503, _} = OpenAI.handle(gone, "GET", "/health", nil)
      assert {:json, 503, _} = OpenAI.handle(gone, "POST", "/tokenize", %{"content" => "x"})
    end
  end

  describe "HTTP/1.1" do
    test "keep-alive, auth, JSON errors, size limits, chunked bodies", %{port: port} do
      {:ok, s} = :gen_tcp.connect({127, 0, 0, 1}, port, [:binary, active: false])

      # two requests on one connection
      for _ <- 1..2 do
        :ok = :gen_tcp.send(s, "GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert {200, body} = read_response(s)
        assert body =~ ~s("status":"ok")
      end

      :ok = :gen_tcp.send(s, "GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
      assert {401, body} = read_response(s)
      assert body =~ ~s("type":"authentication_error")

      post = fn path, body, extra ->
        "POST #{path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sekret\r\n#{extra}" <>
          "content-length: #{byte_size(body)}\r\n\r\n#{body}"
      end

      :ok = :gen_tcp.send(s, post.("/v1/chat/completions", "{not json", ""))
      assert {400, body} = read_response(s)
      assert body =~ "malformed JSON"

      :ok = :gen_tcp.send(s, post.("/v1/nope", "{}", ""))
      assert {404, _} = read_response(s)
      :gen_tcp.close(s)

      {:ok, s} = :gen_tcp.connect({127, 0, 0, 1}, port, [:binary, active: false])
      :ok = :gen_tcp.send(s, post.("/v1/chat/completions", String.duplicate("x", 5000), ""))
      assert {413, _} = read_response(s)
      :gen_tcp.close(s)

      {:ok, s} = :gen_tcp.connect({127, 0, 0, 1}, port, [:binary, active: false])

      :ok =
        :gen_tcp.send(
          s,
          "POST /tokenize HTTP/1.1\r\nauthorization: Bearer sekret\r\ntransfer-encoding: chunked\r\n\r\n"
        )

      assert {411, _} = read_response(s)
      :gen_tcp.close(s)
    end

    test "a client that leaves mid-stream frees its slot", %{port: port, server: server} do
      body =
        ~s({"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 2000, "stream": true})

      {:ok, s} = :gen_tcp.connect({127, 0, 0, 1}, port, [:binary, active: false])

      :ok =
        :gen_tcp.send(
          s,
          "POST /v1/chat/completions HTTP/1.1\r\nauthorization: Bearer sekret\r\n" <>
            "content-length: #{byte_size(body)}\r\n\r\n" <> body
        )

      before = Server.get_stats(server).tokens_generated
      {:ok, first} = :gen_tcp.recv(s, 0, 30_000)
      assert first =~ "text/event-stream"
      # wait until it generates, then leave
      wait_until(fn -> Server.get_stats(server).active_slots == 1 end)
      :gen_tcp.close(s)
      wait_until(fn -> Server.get_stats(server).active_slots == 0 end)
      assert Server.get_stats(server).tokens_generated - before < 2000
    end

    test "a client that stops reading is dropped after :write_timeout" do
      # Its own Server so one sequence may grow past what the stall needs to show.
      {:ok, server} =
        Server.start_link(model_path: TestModels.smollm2_path(), n_parallel: 1, n_ctx: 4096)

      {:ok, _} = TestModels.wait_model(server)
      {:ok, http} = HTTPServer.start_link(server: server, port: 0, write_timeout: 300)

      # End-of-generation tokens banned and 20 logprobs per token (~2 KB a chunk), so the answer
      # outgrows the socket buffers long before it could finish on its own.
      body =
        JSON.encode!(%{
          "messages" => [%{"role" => "user", "content" => "Tell a long story."}],
          "max_tokens" => 3500,
          "stream" => true,
          "logprobs" => true,
          "top_logprobs" => 20,
          "logit_bias" => %{"0" => -100, "2" => -100}
        })

      {:ok, s} =
        :gen_tcp.connect({127, 0, 0, 1}, HTTPServer.port(http), [
          :binary,
          active: false,
          recbuf: 1024
        ])

      :ok =
        :gen_tcp.send(
          s,
          "POST /v1/chat/completions HTTP/1.1\r\ncontent-length: #{byte_size(body)}\r\n\r\n" <>
            body
        )

      # never read: the server's write blocks, times out, and the request is cancelled
      wait_until(fn -> Server.get_stats(server).active_slots == 1 end)
      wait_until(fn -> Server.get_stats(server).active_slots == 0 end, 12_000)
      assert Server.get_stats(server).tokens_generated < 3500
      :gen_tcp.close(s)
      GenServer.stop(http)
      GenServer.stop(server)
    end

    test "the official openai client, and curl for /metrics, /health, /tokenize", %{port: port} do
      url = "http://127.0.0.1:#{port}"
      script = Path.expand("openai_client.py", __DIR__)
      {out, status} = System.cmd("python3", [script, url, "sekret"], stderr_to_stdout: true)
      assert status == 0, out
      assert out =~ "openai_client: all checks passed"

      {metrics, 0} =
        System.cmd("curl", ["-sf", "-H", "authorization: Bearer sekret", url <> "/metrics"])

      assert metrics =~ ~s(llamacppex_requests_total{route="/v1/chat/completions",status="200"})
      assert metrics =~ "llamacppex_time_to_first_token_seconds_count"
      assert metrics =~ "llamacppex_kv_capacity_tokens 8192"
      assert metrics =~ ~r/llamacppex_generation_tokens_total [1-9]/

      {health, 0} = System.cmd("curl", ["-sf", url <> "/health"])
      assert health == ~s({"status":"ok"})

      {tok, 0} =
        System.cmd("curl", [
          "-sf",
          "-H",
          "authorization: Bearer sekret",
          "-d",
          ~s({"content": "Hello"}),
          url <> "/tokenize"
        ])

      assert tok =~ ~r/\{"tokens":\[\d+/
    end
  end

  describe "mix llama_cpp_ex.server" do
    test "serves a model, prints its URL, stops on SIGTERM" do
      mix = System.find_executable("mix")

      port =
        Port.open({:spawn_executable, mix}, [
          :binary,
          :exit_status,
          :stderr_to_stdout,
          args:
            ~w(llama_cpp_ex.server --model #{TestModels.smollm2_path()} --port 0 --alias tiny),
          env: [{~c"MIX_ENV", ~c"test"}, {~c"LLAMA_CPP_EX_SKIP_NATIVE", ~c"1"}]
        ])

      url = CLI.await_url(port)
      {:os_pid, os_pid} = Port.info(port, :os_pid)
      {models, 0} = System.cmd("curl", ["-sf", url <> "/models"])
      assert models =~ ~s("id":"tiny")
      {_, 0} = System.cmd("kill", ["-TERM", "#{os_pid}"])

      assert_receive {^port, {:exit_status, 0}}, 30_000
    end
  end

  describe "mix llama_cpp_ex.server --hf-repo" do
    test "downloads the file through the Hub, then serves it" do
      body = File.read!(TestModels.smollm2_path())

      sha = Base.encode16(:crypto.hash(:sha256, body), case: :lower)

      info =
        LlamaCppEx.JSON.encode!(%{
          "siblings" => [%{"rfilename" => "smol.gguf", "lfs" => %{"sha256" => sha}}]
        })

      # the Hub's file and the metadata it verifies the download against
      hub =
        LlamaCppEx.Test.ArtifactServer.start(%{
          "/org/smol/resolve/main/smol.gguf" => {200, body},
          "/api/models/org/smol/revision/main" => {200, info}
        })

      cache =
        Path.join(System.tmp_dir!(), "llama_cpp_ex_hfrepo_#{System.unique_integer([:positive])}")

      on_exit(fn -> File.rm_rf!(cache) end)

      port =
        Port.open({:spawn_executable, System.find_executable("mix")}, [
          :binary,
          :exit_status,
          :stderr_to_stdout,
          args: ~w(llama_cpp_ex.server --hf-repo org/smol --hf-file smol.gguf --port 0),
          env: [
            {~c"MIX_ENV", ~c"test"},
            {~c"LLAMA_CPP_EX_SKIP_NATIVE", ~c"1"},
            {~c"HF_ENDPOINT", String.to_charlist(hub.url)},
            {~c"LLAMA_CACHE_DIR", String.to_charlist(cache)}
          ]
        ])

      url = CLI.await_url(port)
      assert File.read!(Path.join(cache, "org/smol/main/smol.gguf")) == body
      {models, 0} = System.cmd("curl", ["-sf", url <> "/models"])
      assert models =~ ~s("id":"smol.gguf")
      {:os_pid, os_pid} = Port.info(port, :os_pid)
      {_, 0} = System.cmd("kill", ["-TERM", "#{os_pid}"])
      assert_receive {^port, {:exit_status, 0}}, 30_000
    end
  end

  defp read_response(s) do
    {:ok, data} = recv_all(s, "")
    [head, body] = String.split(data, "\r\n\r\n", parts: 2)
    ["HTTP/1.1 " <> <<code::binary-size(3)>> <> _ | _] = String.split(head, "\r\n")
    {String.to_integer(code), body}
  end

  # one response with a content-length
  defp recv_all(s, acc) do
    case String.split(acc, "\r\n\r\n", parts: 2) do
      [head, body] ->
        [_, len] = Regex.run(~r/content-length: (\d+)/i, head)

        if byte_size(body) >= String.to_integer(len),
          do: {:ok, acc},
          else: more(s, acc)

      [_] ->
        more(s, acc)
    end
  end

  defp more(s, acc) do
    {:ok, data} = :gen_tcp.recv(s, 0, 30_000)
    recv_all(s, acc <> data)
  end
end
