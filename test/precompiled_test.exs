defmodule LlamaCppEx.PrecompiledTest do
  # Precompiled NIF artifacts (mix/llama_cpp_ex/precompiled.ex) against a local HTTP server:
  # no network, no cargo, nothing installed outside temporary folders.
  use ExUnit.Case, async: true

  alias LlamaCppEx.Precompiled
  alias LlamaCppEx.Test.ArtifactServer

  @version "9.9.9"
  @target "x86_64-unknown-linux-gnu"

  setup do
    tmp = Path.join(System.tmp_dir!(), "llama_cpp_ex_pre_#{System.unique_integer([:positive])}")
    File.mkdir_p!(tmp)
    on_exit(fn -> File.rm_rf!(tmp) end)
    name = Precompiled.artifact_name(@version, "2.16", @target, nil)
    %{tmp: tmp, name: name}
  end

  # A tarball of `entries` ({name_in_archive, bytes}), as bytes.
  defp tarball(tmp, entries) do
    path = Path.join(tmp, "t#{System.unique_integer([:positive])}.tar.gz")

    entries = for {n, bytes} <- entries, do: {String.to_charlist(n), bytes}

    :ok = :erl_tar.create(String.to_charlist(path), entries, [:compressed])
    File.read!(path)
  end

  defp opts(tmp, server),
    do: [
      dest: Path.join(tmp, "priv/native"),
      base_url: server.url,
      cache_dir: Path.join(tmp, "cache"),
      env: %{}
    ]

  setup %{tmp: tmp} do
    files = Precompiled.files()
    body = tarball(tmp, [{Enum.at(files, 0), "NIF BYTES"}, {Enum.at(files, 1), "RENDER BYTES"}])
    %{body: body}
  end

  test "download, verify against the checksum, install; then the cache serves it offline",
       %{tmp: tmp, name: name, body: body} do
    server = ArtifactServer.start(%{("/" <> name) => {200, body}})
    sha = Precompiled.sha256(body)
    opts = opts(tmp, server)
    dest = opts[:dest]
    File.mkdir_p!(dest)

    assert :ok = Precompiled.install(name, sha, opts)
    assert File.read!(Path.join(dest, "llama_cpp_ex_nif.so")) == "NIF BYTES"
    assert File.read!(Path.join(dest, "llama_cpp_ex_render")) == "RENDER BYTES"
    assert File.exists?(Path.join([tmp, "cache", name]))
    assert ArtifactServer.requests(server) == 1
    # installed and stamped: nothing to do
    assert {:ok, :already_installed} = Precompiled.install(name, sha, opts)

    # offline: the server is gone, priv was cleaned; the verified cache reinstalls it
    ArtifactServer.stop(server)
    File.rm_rf!(dest)
    File.mkdir_p!(dest)
    assert :ok = Precompiled.install(name, sha, opts)
    assert File.read!(Path.join(dest, "llama_cpp_ex_nif.so")) == "NIF BYTES"
    assert ArtifactServer.requests(server) == 1
  end

  test "HTTP_PROXY is honoured, and NO_PROXY bypasses it", %{tmp: tmp, name: name, body: body} do
    proxy = ArtifactServer.start(%{("/mirror/" <> name) => {200, body}})
    sha = Precompiled.sha256(body)

    opts =
      Keyword.merge(opts(tmp, proxy),
        base_url: "http://mirror.invalid/mirror",
        env: %{"HTTP_PROXY" => proxy.url}
      )

    File.mkdir_p!(opts[:dest])
    assert :ok = Precompiled.install(name, sha, opts)
    assert ArtifactServer.proxied(proxy) == ["mirror.invalid"]

    # NO_PROXY names the mirror: asked directly, the dead proxy is never used
    dead = ArtifactServer.start(%{})
    ArtifactServer.stop(dead)
    direct = ArtifactServer.start(%{("/" <> name) => {200, body}})

    opts =
      Keyword.merge(opts(tmp, direct),
        cache_dir: Path.join(tmp, "cache2"),
        env: %{"http_proxy" => dead.url, "NO_PROXY" => "localhost,127.0.0.1"}
      )

    File.rm_rf!(opts[:dest])
    File.mkdir_p!(opts[:dest])
    assert :ok = Precompiled.install(name, sha, opts)
    assert ArtifactServer.requests(direct) == 1 and ArtifactServer.proxied(direct) == []
  end

  @tag capture_log: true
  test "HTTPS verifies the server: LLAMA_CPP_EX_CACERTFILE adds a CA, an unknown one is refused",
       %{tmp: tmp, name: name, body: body} do
    san = {:Extension, {2, 5, 29, 17}, false, [dNSName: ~c"localhost"]}

    %{server_config: server, client_config: client} =
      :public_key.pkix_test_data(%{
        server_chain: %{
          root: [key: {:namedCurve, :secp256r1}],
          intermediates: [],
          peer: [key: {:namedCurve, :secp256r1}, extensions: [san]]
        },
        client_chain: %{
          root: [key: {:namedCurve, :secp256r1}],
          intermediates: [],
          peer: [key: {:namedCurve, :secp256r1}]
        }
      })

    https =
      ArtifactServer.start(%{("/" <> name) => {200, body}}, Keyword.take(server, [:cert, :key]))

    ca = Path.join(tmp, "ca.pem")
    pem = for der <- client[:cacerts], do: {:Certificate, der, :not_encrypted}
    File.write!(ca, :public_key.pem_encode(pem))
    sha = Precompiled.sha256(body)
    opts = opts(tmp, https)
    File.mkdir_p!(opts[:dest])

    # the OS store does not know this CA: nothing is downloaded
    assert {:error, msg} = Precompiled.install(name, sha, opts)
    assert msg =~ "cannot download #{name} from https://localhost:" and msg =~ "unknown_ca"
    refute File.exists?(Path.join(opts[:dest], "llama_cpp_ex_nif.so"))

    opts = Keyword.put(opts, :env, %{"LLAMA_CPP_EX_CACERTFILE" => ca})
    assert :ok = Precompiled.install(name, sha, opts)
    assert File.read!(Path.join(opts[:dest], "llama_cpp_ex_nif.so")) == "NIF BYTES"
  end

  test "offline with nothing cached says what to do", %{tmp: tmp, name: name, body: body} do
    server = ArtifactServer.start(%{})
    ArtifactServer.stop(server)

    assert {:error, msg} = Precompiled.install(name, Precompiled.sha256(body), opts(tmp, server))
    assert msg =~ "cannot download #{name} from #{server.url}/#{name}"
    assert msg =~ "LLAMA_CPP_EX_BASE_URL" and msg =~ "LLAMA_CPP_EX_BUILD=1"
    refute File.exists?(Path.join([tmp, "priv/native/llama_cpp_ex_nif.so"]))
  end

  test "a checksum mismatch installs and caches nothing", %{tmp: tmp, name: name, body: body} do
    server = ArtifactServer.start(%{("/" <> name) => {200, body <> "x"}})
    opts = opts(tmp, server)
    File.mkdir_p!(opts[:dest])

    assert {:error, msg} = Precompiled.install(name, Precompiled.sha256(body), opts)
    assert msg =~ "checksum mismatch for #{name}" and msg =~ "was not installed"
    assert File.ls!(opts[:dest]) == []
    refute File.exists?(Path.join([tmp, "cache", name]))

    # a cached file that no longer matches is not trusted either: it is fetched again
    File.mkdir_p!(Path.join(tmp, "cache"))
    File.write!(Path.join([tmp, "cache", name]), "tampered")
    ArtifactServer.put(server, "/" <> name, {200, body})
    assert :ok = Precompiled.install(name, Precompiled.sha256(body), opts)
    assert File.read!(Path.join([tmp, "cache", name])) == body
  end

  test "a truncated transfer is an error naming the file", %{tmp: tmp, name: name, body: body} do
    half = binary_part(body, 0, div(byte_size(body), 2))
    server = ArtifactServer.start(%{("/" <> name) => {:truncate, half, byte_size(body)}})
    opts = opts(tmp, server)
    File.mkdir_p!(opts[:dest])

    assert {:error, msg} = Precompiled.install(name, Precompiled.sha256(body), opts)
    assert msg =~ name
    assert msg =~ ~r/truncated|cannot download/
    assert File.ls!(opts[:dest]) == []
  end

  test "a 404 says which file is missing where", %{tmp: tmp, name: name, body: body} do
    server = ArtifactServer.start(%{})
    opts = opts(tmp, server)

    assert {:error, msg} = Precompiled.install(name, Precompiled.sha256(body), opts)
    assert msg =~ "HTTP 404 for #{server.url}/#{name}" and msg =~ "LLAMA_CPP_EX_BASE_URL"
  end

  test "archives that reach outside their folder, hold links or lack a file are refused",
       %{tmp: tmp, name: name} do
    [nif, render] = Precompiled.files()
    link_dir = Path.join(tmp, "links")
    File.mkdir_p!(link_dir)
    File.ln_s!("/etc/passwd", Path.join(link_dir, render))

    link_tar = Path.join(tmp, "link.tar.gz")

    :ok =
      :erl_tar.create(
        String.to_charlist(link_tar),
        [
          {String.to_charlist(nif), "x"},
          {String.to_charlist(render), String.to_charlist(Path.join(link_dir, render))}
        ],
        [:compressed]
      )

    cases = [
      {tarball(tmp, [{nif, "x"}, {"../" <> render, "evil"}]), "../" <> render},
      {tarball(tmp, [{nif, "x"}, {"/tmp/" <> render, "evil"}]), render},
      {tarball(tmp, [{nif, "x"}, {"sub/" <> render, "evil"}]), "sub/" <> render},
      {File.read!(link_tar), "symlink"},
      {tarball(tmp, [{nif, "x"}]), "lacks #{render}"}
    ]

    for {{body, expected}, i} <- Enum.with_index(cases) do
      server = ArtifactServer.start(%{("/" <> name) => {200, body}})
      opts = Keyword.put(opts(tmp, server), :cache_dir, Path.join(tmp, "cache#{i}"))
      dest = opts[:dest]
      File.rm_rf!(dest)
      File.mkdir_p!(dest)

      assert {:error, msg} = Precompiled.install(name, Precompiled.sha256(body), opts)
      assert msg =~ expected, msg
      assert msg =~ name
      assert File.ls!(dest) == []
      refute File.exists?(Path.join(tmp, "evil"))
      ArtifactServer.stop(server)
    end
  end

  describe "decide/1" do
    setup %{tmp: tmp, name: name} do
      Precompiled.write_checksums(tmp, %{name => "sha256:abc"})
      %{base: [root: tmp, version: @version, nif_version: "2.16"]}
    end

    test "picks the artifact for this target, NIF version and backend", %{base: base, name: name} do
      env = %{"LLAMA_CPP_EX_TARGET" => @target}
      assert {:precompiled, ^name, "sha256:abc"} = Precompiled.decide(base ++ [env: env])
      # a newer VM loads the 2.16 artifact
      assert {:precompiled, ^name, _} =
               Precompiled.decide(Keyword.put(base, :nif_version, "2.17") ++ [env: env])
    end

    test "builds from source on request, in a checkout, for unknown targets and variants",
         %{base: base, tmp: tmp} do
      env = %{"LLAMA_CPP_EX_TARGET" => @target}

      assert {:source, "LLAMA_CPP_EX_BUILD=1"} =
               Precompiled.decide(base ++ [env: Map.put(env, "LLAMA_CPP_EX_BUILD", "1")])

      assert {:source, "no precompiled artifact is published for riscv64gc-unknown-linux-gnu"} =
               Precompiled.decide(
                 base ++ [env: %{"LLAMA_CPP_EX_TARGET" => "riscv64gc-unknown-linux-gnu"}]
               )

      assert {:source, msg} =
               Precompiled.decide(base ++ [env: Map.put(env, "LLAMA_BACKEND", "cuda")])

      assert msg =~ "(LLAMA_BACKEND=cuda)"

      assert {:source, "no precompiled artifact for NIF version 2.15"} =
               Precompiled.decide(Keyword.put(base, :nif_version, "2.15") ++ [env: env])

      File.rm!(Path.join(tmp, Precompiled.checksum_file()))
      assert {:source, :checkout} = Precompiled.decide(base ++ [env: env])
    end

    test "a published target missing from the checksum file is an error", %{base: base} do
      env = %{"LLAMA_CPP_EX_TARGET" => "aarch64-unknown-linux-gnu"}
      assert {:error, msg} = Precompiled.decide(base ++ [env: env])
      assert msg =~ "has no entry for llama_cpp_ex-v9.9.9-nif-2.16-aarch64-unknown-linux-gnu"
      assert msg =~ "LLAMA_CPP_EX_BUILD=1"
    end

    test "an unreadable checksum file is an error naming it", %{base: base, tmp: tmp} do
      File.write!(Path.join(tmp, Precompiled.checksum_file()), "%{oops")
      assert {:error, "cannot read " <> _} = Precompiled.decide(base ++ [env: %{}])
    end
  end

  test "the target triple of this VM" do
    assert {:ok, t} = Precompiled.target(%{})
    assert t =~ ~r/^(x86_64|aarch64)-(unknown-linux-(gnu|musl)|apple-darwin)$/
  end

  test "a source build without cargo fails with what to do" do
    assert :ok = Precompiled.check_cargo(:checkout, "/usr/bin/cargo")

    assert {:error, msg} =
             Precompiled.check_cargo("no precompiled artifact is published for riscv64", nil)

    assert msg =~ "built from source here (no precompiled artifact is published for riscv64)"
    assert msg =~ "needs cargo" and msg =~ "https://rustup.rs"

    assert {:error, msg} = Precompiled.check_cargo(:checkout, nil)
    assert msg =~ "(no checksum-Elixir.LlamaCppEx.NIF.exs)"
  end
end
